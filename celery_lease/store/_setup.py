"""The schema's version, migrating it, and letting go of the engine."""

from __future__ import annotations

from ..exceptions import SchemaOutOfDate
from . import migrations
from ._base import StoreBase
from .schema import SCHEMA_VERSION


class SetupMixin(StoreBase):
    def schema_version(self) -> int | None:
        """The applied schema version (``None``: no lease tables)."""
        return self._read(lambda conn: migrations.current_version(conn, self.t))

    def migrate(self) -> tuple[int | None, int]:
        """Create or upgrade the lease tables; returns (version before, version after)."""
        result = self._tx(lambda conn, _: migrations.migrate(conn, self.t))
        self._schema_checked = True
        return result

    def ensure_schema(self, *, auto_migrate: bool | None = None) -> None:
        """Check the schema once per process; create it on SQLite or when auto-migrate is on."""
        if self._schema_checked:
            return
        current = self.schema_version()
        if current != SCHEMA_VERSION:
            auto = self.config.auto_migrate if auto_migrate is None else auto_migrate
            if not (auto or self.dialect == "sqlite") or (current or 0) > SCHEMA_VERSION:
                raise SchemaOutOfDate(current, SCHEMA_VERSION, self.url)
            self.migrate()
        self._schema_checked = True

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()
