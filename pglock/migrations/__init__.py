"""pglock's Alembic revisions, shipped inside the package.

``versions/`` holds the revisions of the ``pglock`` branch (branch label ``pglock``). Three ways
to apply them, all equivalent and all safe to run concurrently:

* ``pglock install --dsn DSN [--schema S]`` (no Alembic needed: :func:`pglock._schema.install`
  runs the same statements);
* your own Alembic: add :data:`VERSIONS_DIR` to ``version_locations`` and run
  ``alembic upgrade pglock@head``;
* from a checkout of pglock: ``alembic upgrade head`` with the repository's ``alembic.ini``.

The schema name (default ``pglock``) comes from ``config.attributes["pglock_schema"]``, then
``-x pglock_schema=...``, then the ``pglock_schema`` option of the ini file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._contract import DEFAULT_SCHEMA, validate_schema

#: The directory to add to Alembic's ``version_locations``.
VERSIONS_DIR = str(Path(__file__).resolve().parent / "versions")

#: The Alembic branch label of pglock's revisions: ``alembic upgrade pglock@head``.
BRANCH_LABEL = "pglock"

__all__ = ["BRANCH_LABEL", "VERSIONS_DIR", "alembic_execute", "alembic_schema"]


def alembic_schema() -> str:
    """The schema a revision installs into, when it runs under Alembic (validated).

    Looked up in ``config.attributes["pglock_schema"]``, ``-x pglock_schema=...`` and the
    ``pglock_schema`` ini option, in that order; ``pglock`` when none is set.
    """
    from alembic import context

    config = context.config
    value = config.attributes.get("pglock_schema")
    if value is None:
        value = context.get_x_argument(as_dictionary=True).get("pglock_schema")
    if value is None:
        value = config.get_main_option("pglock_schema")
    return validate_schema(str(value) if value else DEFAULT_SCHEMA)


def alembic_execute(statements: list[Any]) -> None:
    """Run composed statements through Alembic: verbatim on the connection (online), or as
    SQL text (offline, ``alembic upgrade --sql``)."""
    from alembic import context, op

    # The text goes out verbatim: no bind-parameter parsing of ':name' (SQLAlchemy text())
    # nor of '%' (psycopg placeholders), which PL/pgSQL bodies are full of.
    if context.is_offline_mode():
        impl = op.get_context().impl
        for stmt in statements:
            impl.static_output(stmt.as_string(None).strip() + impl.command_terminator)
        return
    bind = op.get_bind()
    for stmt in statements:
        bind.exec_driver_sql(stmt.as_string(None), execution_options={"no_parameters": True})
