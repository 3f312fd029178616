"""The pglock schema: the shipped revisions and :func:`install` (what ``pglock install`` runs).

Revisions take the install lock and record themselves in ``<schema>.schema_revision`` under
Alembic too, so a schema installed here can later be adopted by the user's Alembic.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from . import _classify, _conn, _sql
from ._classify import Kind, classify
from ._contract import DEFAULT_SCHEMA, install_lock_key, validate_schema
from ._deadline import connect_extra
from .migrations import PIN_SEARCH_PATH, VERSIONS_DIR, trusted_schema


@dataclass(frozen=True)
class Revision:
    """One shipped revision of the ``pglock`` branch."""

    revision: str
    down_revision: str | None
    module: ModuleType

    def upgrade_statements(self, schema: str) -> list[sql.Composed]:
        fn = getattr(self.module, "upgrade_statements", None)
        if fn is None:
            raise RuntimeError(
                f"revision {self.revision} has no upgrade_statements(); apply it with Alembic "
                "('alembic upgrade pglock@head')"
            )
        return cast("list[sql.Composed]", fn(schema))


def revisions() -> list[Revision]:
    """The shipped revisions, from the root of the ``pglock`` branch to its head."""
    return list(_load_revisions())


def head() -> str:
    """The newest shipped revision id."""
    return revisions()[-1].revision


@cache
def _load_revisions() -> tuple[Revision, ...]:
    by_down: dict[str | None, Revision] = {}
    for path in sorted(Path(VERSIONS_DIR).glob("[!_]*.py")):
        module = importlib.import_module(f"pglock.migrations.versions.{path.stem}")
        rev = getattr(module, "revision", None)
        if not isinstance(rev, str):
            continue
        down: Any = getattr(module, "down_revision", None)
        if isinstance(down, (tuple, list)):
            raise RuntimeError(f"revision {rev} is a merge point; pglock's branch is linear")
        if down in by_down:
            raise RuntimeError(
                f"revisions {by_down[down].revision} and {rev} both follow {down!r}: "
                "pglock's branch must be linear"
            )
        by_down[down] = Revision(rev, down, module)
    ordered: list[Revision] = []
    current: str | None = None  # the root revision has down_revision None
    while current in by_down and len(ordered) <= len(by_down):
        ordered.append(by_down[current])
        current = ordered[-1].revision
    if len(ordered) != len(by_down):
        raise RuntimeError("some pglock revisions are not reachable from the root revision")
    if not ordered:
        raise RuntimeError(f"no pglock revisions found in {VERSIONS_DIR}")
    return tuple(ordered)


def installed_revisions(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> list[str]:
    """The pglock revisions recorded in ``schema`` of ``conn``'s database (``[]``: none), read
    in the caller's transaction if one is open."""
    schema = validate_schema(schema)
    rows = _conn.fetch(conn, _sql.schema_revision_table(schema))[0]
    if not rows or rows[0][0] is None:
        return []
    return [r[0] for r in _conn.fetch(conn, _sql.schema_revisions(schema))[0]]


def install(target: str | psycopg.Connection[Any], *, schema: str = DEFAULT_SCHEMA) -> list[str]:
    """Install or upgrade the pglock schema; return the revisions applied now (``[]`` when it
    was already up to date).

    :param target: a DSN (pglock opens and closes a connection) or an idle psycopg
        ``Connection`` (its transaction is committed here).
    :param schema: the schema to install into (validated; default ``pglock``).
    :raises TypeError, ValueError: a bad schema name or target, before any SQL.
    :raises pglock.InvalidConnectionState: a closed connection, or one pglock used in the parent
        of this forked process.
    :raises psycopg.Error: the database refused (no privilege, unreachable server, ...).

    Safe to run concurrently: installs of one schema serialize on an advisory lock.

    Example::

        pglock.install("postgresql://app@db/app", schema="pglock")
    """
    schema = validate_schema(schema)
    plan = revisions()
    if classify(target, (Kind.DSN, Kind.CONNECTION), api="install()") is Kind.DSN:
        dsn = _classify.dsn(target)
        with psycopg.connect(make_conninfo(dsn, **connect_extra(dsn)), autocommit=True) as conn:
            return _install(conn, schema, plan)
    conn = _conn.resolve(target, "install()").conn  # open, not a forked parent's
    if conn.info.transaction_status != _conn.IDLE:
        raise ValueError("install() needs an idle connection (commit or roll back first)")
    return _install(conn, schema, plan)


def _install(conn: psycopg.Connection[Any], schema: str, plan: list[Revision]) -> list[str]:
    applied: list[str] = []
    with conn.transaction():
        _conn.fetch(conn, PIN_SEARCH_PATH)  # until the commit
        _conn.fetch(conn, _sql.schema_install_lock(install_lock_key(schema)))
        _conn.fetch(conn, trusted_schema(schema))  # before reading anything of it
        done = set(installed_revisions(conn, schema))
        for rev in plan:
            if rev.revision in done:
                continue
            for stmt in rev.upgrade_statements(schema):
                _conn.fetch(conn, stmt)
            applied.append(rev.revision)
    return applied


__all__ = ["Revision", "head", "install", "installed_revisions", "revisions"]
