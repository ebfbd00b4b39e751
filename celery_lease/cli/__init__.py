"""``celery -A proj lease ...``: registered through the ``celery.commands`` entry point.

Readable tables on a terminal (colour only there; ``-C``/``NO_COLOR`` turn it off),
``--json`` for scripts, one-line errors and distinct exit codes:

====  ==========================================================================
0     done
1     refused: the transition table does not allow it (or another library error)
2     bad input: unknown option or state, malformed duration or JSON, bad settings
3     the lease database (or the broker) is unreachable, or the schema is out of date
4     no task with this id
====  ==========================================================================

A command on several ids tries every id and exits with the worst code met (3, then 2,
then 4, then 1), not the first; an unreachable store stops it at once (3).
"""

from __future__ import annotations

# the commands register themselves on the group
from . import _acting, _incident, _maintenance, _reading  # noqa: F401
from ._common import (
    EXIT_NOT_FOUND,
    EXIT_REFUSED,
    EXIT_STORE,
    EXIT_USAGE,
    EXIT_VIOLATIONS,
    NOTIFY_TIMEOUT,
    exit_code,
    handle_errors,
    lease,
    parse_duration,
)
from ._reading import actions
from ._render import STATE_COLORS, Table, ago, span

__all__ = [
    "EXIT_NOT_FOUND",
    "EXIT_REFUSED",
    "EXIT_STORE",
    "EXIT_USAGE",
    "EXIT_VIOLATIONS",
    "NOTIFY_TIMEOUT",
    "STATE_COLORS",
    "Table",
    "actions",
    "ago",
    "exit_code",
    "handle_errors",
    "lease",
    "parse_duration",
    "span",
]
