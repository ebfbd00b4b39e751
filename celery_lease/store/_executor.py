"""What a store operation runs its statements on: a typed executor protocol.

An operation that may join a caller's transaction takes an :class:`Executor` and runs
each statement, built once, as ``conn.execute(prepared, params)``. A SQLAlchemy
``Connection`` is an executor as it is; a framework that owns its own connection (the
Django adapter, ``celery_lease.contrib.django``) implements the protocol once, on its
connection, instead of the store writing each operation a second time for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import Executable


class Rows(Protocol):
    """What the store reads of an executed statement (a SQLAlchemy ``Result`` has it)."""

    @property
    def rowcount(self) -> int:
        """Rows the statement matched (an UPDATE or DELETE)."""
        ...

    def scalar(self) -> Any:
        """The first column of the first row, or ``None`` when there is no row."""
        ...

    def first(self) -> Any:
        """The first row (its columns by position and by name), or ``None``."""
        ...

    def all(self) -> Sequence[Any]:
        """Every row."""
        ...


class Executor(Protocol):
    """Runs one statement with its bind parameters, in whatever transaction it is in.

    ``statement`` is built by the store with bind parameters (``bindparam("b_id")``)
    that ``parameters`` fills by name; the executor never commits or rolls back.
    """

    def execute(
        self, statement: Executable, parameters: Mapping[str, Any] | None = None, /
    ) -> Rows: ...
