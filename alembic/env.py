"""pglock's development Alembic environment: ``alembic upgrade head`` from a checkout.

The database is ``-x dsn=...`` or ``$PGLOCK_DSN`` (a libpq URL or key=value string); the schema
is ``-x schema=...`` (default ``pglock``), handed to the revisions through
``config.attributes["pglock_schema"]``. Concurrent runs serialize on
:func:`pglock.alembic.migration_lock`; the revisions also take their own transaction-level
advisory lock, so ``pglock install`` runs at the same time are safe too.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

import psycopg
import sqlalchemy as sa

from alembic import context
from pglock._contract import DEFAULT_SCHEMA, validate_schema
from pglock.alembic import migration_lock

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

_x = context.get_x_argument(as_dictionary=True)
SCHEMA = validate_schema(
    _x.get("schema")
    or _x.get("pglock_schema")
    or config.attributes.get("pglock_schema")
    or config.get_main_option("pglock_schema")
    or DEFAULT_SCHEMA
)
config.attributes["pglock_schema"] = SCHEMA


def _dsn() -> str:
    dsn = _x.get("dsn") or os.environ.get("PGLOCK_DSN")
    if not dsn:
        raise SystemExit("pglock alembic env: no database: pass -x dsn=... or set PGLOCK_DSN")
    return dsn


def run_migrations_offline() -> None:
    """``alembic upgrade head --sql``: print the SQL instead of running it."""
    context.configure(
        url="postgresql+psycopg://",
        dialect_name="postgresql",
        literal_binds=True,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    dsn = _dsn()
    engine = sa.create_engine(
        "postgresql+psycopg://",
        creator=lambda: psycopg.connect(dsn),
        poolclass=sa.pool.NullPool,
    )
    lock = migration_lock(engine, f"pglock:alembic:{SCHEMA}", timeout=600)
    try:
        with lock, engine.connect() as connection:
            context.configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
