"""Helpers shared by the lease tests (this module holds no tests).

Every lease test module works in a database of its own (``pglock_lease_<random>``) with the
pglock schema installed by :func:`pglock._schema.install`: other helpers' tests install and
drop schemas in the shared ``test`` database at the same time. Sessions carry the test's
``application_name`` so that a test can find its own backends in ``pg_stat_activity``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from _pgdb import throwaway_database
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pglock import _lease


@contextlib.contextmanager
def lease_database(
    pg_dsn: str, *, install: bool = True, schemas: tuple[str, ...] = ("pglock",)
) -> Iterator[str]:
    """A new database next to ``pg_dsn``'s, with the schema(s) installed; dropped afterwards."""
    with throwaway_database(pg_dsn, prefix="pglock_lease", install=install, schemas=schemas) as d:
        try:
            yield d
        finally:
            _lease.shutdown()  # before the drop: no keepalive thread is left on the database


def with_app(dsn: str, app_name: str) -> str:
    """``dsn`` with the test's application_name."""
    return make_conninfo(dsn, application_name=app_name)


def token_state(conn: psycopg.Connection[Any], schema: str = "pglock") -> tuple[Any, ...]:
    """(last_value, is_called) of the token sequence: did anything draw a token?"""
    row = conn.execute(
        sql.SQL("SELECT last_value, is_called FROM {}.lease_token").format(
            sql.Identifier(schema)
        )
    ).fetchone()
    assert row is not None
    return tuple(row)


def lease_rows(conn: psycopg.Connection[Any], schema: str = "pglock") -> list[tuple[Any, ...]]:
    """Every row of the lease table: (name, holder, token, expires_at, waiters)."""
    return conn.execute(
        sql.SQL(
            "SELECT name, holder, token, expires_at, waiters FROM {}.lease ORDER BY name"
        ).format(sql.Identifier(schema))
    ).fetchall()


def row_of(
    conn: psycopg.Connection[Any], name: str, schema: str = "pglock"
) -> tuple[Any, ...] | None:
    """(holder, token, acquired_at, expires_at, waiters, expired?) of one lease row."""
    return conn.execute(
        sql.SQL(
            "SELECT holder, token, acquired_at, expires_at, waiters,"
            " expires_at <= clock_timestamp() FROM {}.lease WHERE name = %s"
        ).format(sql.Identifier(schema)),
        (name,),
    ).fetchone()


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.01) -> Any:
    """Poll ``predicate`` until it returns something truthy or ``timeout`` passes (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def backends(conn: psycopg.Connection[Any], app_name: str) -> list[tuple[Any, ...]]:
    """(pid, state, wait_event_type, wait_event, query) of the test's other sessions."""
    return conn.execute(
        "SELECT pid, state, wait_event_type, wait_event, query FROM pg_stat_activity"
        " WHERE application_name = %s AND pid <> pg_backend_pid()",
        (app_name,),
    ).fetchall()


def sleep_until_expired(conn: psycopg.Connection[Any], name: str, timeout: float = 10.0) -> None:
    """Block until the lease row ``name`` is expired on the database clock (bounded)."""
    row = row_of(conn, name)
    assert row is not None, f"no lease row for {name!r}"
    left = conn.execute(
        "SELECT extract(epoch FROM %s::timestamptz - clock_timestamp())::float8", (row[3],)
    ).fetchone()
    assert left is not None
    if left[0] > 0:
        time.sleep(min(left[0] + 0.01, timeout))
    assert wait_until(lambda: (r := row_of(conn, name)) is None or r[5], timeout)
