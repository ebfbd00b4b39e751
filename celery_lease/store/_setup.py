"""The schema's version, migrating it, dropping a schema of its own, and letting go of
the engine."""

from __future__ import annotations

from sqlalchemy.schema import DropSchema

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

    def drop_schema(self) -> None:
        """Drop the store's PostgreSQL schema (``lease_schema``) with everything in it,
        if it exists: the end of a store made for one test run. Nothing happens for a
        store without a schema of its own."""
        schema = self.config.schema
        if schema is not None:
            self._tx(lambda conn, _: conn.execute(DropSchema(schema, cascade=True, if_exists=True)))

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()
