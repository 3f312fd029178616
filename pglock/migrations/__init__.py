"""pglock's Alembic revisions (branch ``pglock``), shipped inside the package; their SQL is in
``pglock/sql/``. The ways to apply them, and the ``pglock_schema`` option: docs/leases.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from psycopg import sql

from .._contract import DEFAULT_SCHEMA, SCHEMA_OPEN, install_lock_key, validate_schema

#: The directory to add to Alembic's ``version_locations``.
VERSIONS_DIR = str(Path(__file__).resolve().parent / "versions")

#: The Alembic branch label of pglock's revisions: ``alembic upgrade pglock@head``.
BRANCH_LABEL = "pglock"

#: Around the revisions' statements, in their transaction: their DDL (column and parameter
#: types, defaults, checks, collations, signatures) resolves names in pg_catalog alone, whatever
#: the installer's search_path, which is then set back for what follows (a user's migrations).
PIN_SEARCH_PATH = sql.SQL(
    "SELECT pg_catalog.set_config('pglock.search_path',"
    " pg_catalog.current_setting('search_path'), true);"
    " SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true)"
).format()
RESTORE_SEARCH_PATH = sql.SQL(
    "SELECT pg_catalog.set_config('search_path',"
    " pg_catalog.current_setting('pglock.search_path'), true)"
).format()

#: Before any revision reads or writes the schema: create it if it is missing (the installing
#: role owns it then), else refuse (42501) one that is not the installing role's (or a
#: superuser's), or that another role may create objects in. The install's DDL reuses what
#: exists (CREATE ... IF NOT EXISTS), and its SECURITY DEFINER functions run with the
#: installer's rights: a schema planted by another role would get them.
TRUSTED_SCHEMA = (
    "DO $pglock$BEGIN IF NOT EXISTS (SELECT FROM pg_catalog.pg_namespace n"  # noqa: S608
    " WHERE n.nspname OPERATOR(pg_catalog.=) {name}) THEN CREATE SCHEMA {schema};"
    " ELSIF EXISTS (SELECT FROM pg_catalog.pg_namespace n"
    " JOIN pg_catalog.pg_roles o ON o.oid OPERATOR(pg_catalog.=) n.nspowner"
    " WHERE n.nspname OPERATOR(pg_catalog.=) {name} AND (NOT (o.rolsuper"
    " OR o.rolname OPERATOR(pg_catalog.=) CURRENT_USER) OR " + SCHEMA_OPEN + ")) THEN"
    " RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = {message}; END IF; END$pglock$"
)


def trusted_schema(schema: str) -> sql.Composed:
    """:data:`TRUSTED_SCHEMA` for ``schema``."""
    message = (
        f"pglock: schema {schema} exists and is not the installing role's: another role owns "
        "it, may create objects in it or owns one of them; install as its owner, or drop it"
    )
    return sql.SQL(TRUSTED_SCHEMA).format(
        name=sql.Literal(schema), schema=sql.Identifier(schema), message=sql.Literal(message)
    )


__all__ = [
    "BRANCH_LABEL",
    "VERSIONS_DIR",
    "alembic_execute",
    "alembic_schema",
    "revision_functions",
    "sql_file",
    "sql_text",
    "statements",
]

# What a statement's ";" can hide behind: dollar quotes, string literals, comments.
_TOKEN = re.compile(r"\$(\w*)\$.*?\$\1\$|'(?:[^']|'')*'|--[^\n]*|;", re.DOTALL)
# Blank lines and comment lines before a statement (not sent).
_LEADING = re.compile(r"\A(?:\s*--[^\n]*)*\s*")


def sql_file(name: str) -> str:
    """The text of ``pglock/sql/<name>.sql`` (``name`` such as ``0001_leases.up``)."""
    return (resources.files("pglock") / "sql" / f"{name}.sql").read_text("utf-8")


@cache
def split(name: str) -> tuple[str, ...]:
    """The statements of ``pglock/sql/<name>.sql``, in order (see :func:`_split_text`)."""
    return tuple(_split_text(sql_file(name)))


def _split_text(text: str) -> list[str]:
    """Each statement ends with ``;`` outside quotes and comments; comments between
    statements are dropped."""
    found: list[str] = []
    start = 0
    for match in _TOKEN.finditer(text):
        if match.group() == ";":
            found.append(_LEADING.sub("", text[start : match.start()], count=1).rstrip())
            start = match.end()
    if _LEADING.sub("", text[start:], count=1):
        raise ValueError("SQL text ends with a statement without ';'")
    return found


def sql_text(template: str, schema: sql.Identifier) -> sql.Literal:
    """``template`` with ``schema`` filled, as a string literal (for dynamic SQL in PL/pgSQL)."""
    return sql.Literal(sql.SQL(template).format(schema).as_string(None))


def statements(name: str, names: Mapping[str, sql.Composable]) -> list[sql.Composed]:
    """The statements of ``pglock/sql/<name>.sql`` with their ``{placeholders}`` filled."""
    return [sql.SQL(text).format(**names) for text in split(name)]


def alembic_schema() -> str:
    """The schema a revision installs into under Alembic (validated): from
    ``config.attributes["pglock_schema"]``, ``-x pglock_schema=...`` or the ``pglock_schema``
    ini option, in that order; else ``pglock``."""
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
    SQL text (offline, ``alembic upgrade --sql``), between :data:`PIN_SEARCH_PATH` (and the
    check of :data:`TRUSTED_SCHEMA`) and :data:`RESTORE_SEARCH_PATH`."""
    from alembic import context, op

    statements = [PIN_SEARCH_PATH, trusted_schema(alembic_schema()), *statements,
                  RESTORE_SEARCH_PATH]
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


_Statements = Callable[[str], list[sql.Composed]]


def revision_functions(
    stem: str, revision: str, names: Callable[[str], Mapping[str, sql.Composable]] = lambda s: {}
) -> tuple[_Statements, _Statements, Callable[[], None], Callable[[], None]]:
    """A revision's ``upgrade_statements``, ``downgrade_statements`` (for a schema, run in one
    transaction), ``upgrade`` and ``downgrade`` (Alembic's), from ``pglock/sql/<stem>.*.sql``
    with the placeholders every revision has (``s``: the schema, ``rev``: the revision, ``lock``:
    the install lock's key) and those ``names(schema)`` adds."""

    def _all(schema: str) -> dict[str, sql.Composable]:
        common = {"s": sql.Identifier(schema), "rev": sql.Literal(revision),
                  "lock": sql.Literal(install_lock_key(schema))}
        return {**common, **names(schema)}

    def upgrade_statements(schema: str) -> list[sql.Composed]:
        return statements(f"{stem}.up", _all(schema))

    def downgrade_statements(schema: str) -> list[sql.Composed]:
        return statements(f"{stem}.down", _all(schema))

    def upgrade() -> None:
        alembic_execute(upgrade_statements(alembic_schema()))

    def downgrade() -> None:
        alembic_execute(downgrade_statements(alembic_schema()))

    return upgrade_statements, downgrade_statements, upgrade, downgrade
