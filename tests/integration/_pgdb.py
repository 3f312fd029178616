"""Throwaway databases for tests that need their own (the pglock schema installed or not).

Used by the introspection, CLI and docs-example tests: the shared ``test`` database is used
by every helper at once, and other tests install and drop the pglock schema there.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo


def install_schema(dsn: str) -> None:
    """Install the pglock schema (every shipped revision) into the database at ``dsn``."""
    from pglock import _schema

    _schema.install(dsn)


@contextlib.contextmanager
def throwaway_database(pg_dsn: str, *, prefix: str, install: bool) -> Iterator[str]:
    """Create a database next to ``pg_dsn``'s, yield its libpq DSN, drop it afterwards."""
    dbname = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    params = conninfo_to_dict(pg_dsn)
    params["dbname"] = dbname
    dsn = make_conninfo(**params)
    try:
        if install:
            install_schema(dsn)
        yield dsn
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            # FORCE ends sessions still connected to it: only this test's, as the name is new.
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )
