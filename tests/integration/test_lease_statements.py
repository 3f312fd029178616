"""Lease statements sent straight through libpq (``pglock._conn.fetch(..., libpq=True)``): the
rows equal what psycopg's cursor and loaders give, and the statements prepared per connection
survive a ``DISCARD ALL``, or are never prepared where the connection's owner said so."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest

import pglock
from pglock import _conn, _lease_rows


def _both(conn: psycopg.Connection[Any], kind: str, params: tuple[Any, ...]) -> list[Any]:
    """The rows of a read-only statement both ways (all but its last column, which moves)."""
    query = _lease_rows.stmt(kind, "pglock")
    direct = _conn.fetch(conn, query, params, libpq=True)[0]
    cursor = _conn.fetch(conn, query, params)[0]
    assert [r[:-1] for r in direct] == [r[:-1] for r in cursor]
    assert [type(v) for r in direct for v in r] == [type(v) for r in cursor for v in r]
    return direct


@pytest.mark.parametrize("tz", ["UTC", "America/St_Johns"])
def test_rows_equal_the_cursor_path(dsn: str, tz: str) -> None:
    name = f"stmt:{uuid.uuid4()}"
    meta = json.dumps({"by": "ünïcode", "n": [1, 2.5, None]})
    with psycopg.connect(dsn, autocommit=True, options=f"-c TimeZone={tz}") as conn:
        query = _lease_rows.stmt("acquire_v4", "pglock")
        (granted, holder, token, acquired, expires, _, waiter), = _conn.fetch(
            conn, query, (name, "h1", 30, meta, 0.0, True, 1.0), libpq=True
        )[0]
        assert (granted, holder, waiter) == (True, "h1", None)
        assert acquired.tzinfo is not None and acquired.utcoffset() == conn.execute(
            "SELECT %s::timestamptz", (acquired,)
        ).fetchone()[0].utcoffset()
        (info,) = _both(conn, "info", (name,))
        assert info[:5] == (name, "h1", token, acquired, expires)
        assert info[5] == json.loads(meta) and isinstance(info[6], float)
        refused = _conn.fetch(conn, query, (name, "h2", 30.0, None, 0.0, True, 1.0), libpq=True)
        assert refused[0][0][:3] == (False, "h1", None)
        released = _conn.fetch(
            conn, _lease_rows.stmt("release_v4", "pglock"), (name, "h1", token), libpq=True
        )
        assert released == [[("released", False, None, None, None, None, None)]]


def _prepared(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE '\\_pglock\\_%'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_prepared_once_and_again_after_discard_all(dsn: str) -> None:
    name = f"stmt:{uuid.uuid4()}"
    source = _lease_rows.make_source(dsn)  # one connection, kept idle between statements

    def look(discard: bool = False) -> int:
        conn, done = source._checkout(None, False, None)
        try:
            if discard:
                conn.execute("DISCARD ALL")
            return _prepared(conn)
        finally:
            done()

    for _ in range(3):
        with pglock.lease(dsn, name, ttl=30, timeout=0):
            pass
    assert look() == 2  # acquire_v4 and release_v4, once each
    assert look(discard=True) == 0
    with pglock.lease(dsn, name, ttl=30, timeout=0):  # "does not exist": prepared again
        pass
    assert look() == 2


def test_never_prepared_with_prepare_threshold_none(dsn: str) -> None:
    name = f"stmt:{uuid.uuid4()}"
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        query = _lease_rows.stmt("acquire_v4", "pglock")
        for _ in range(3):
            row = _conn.fetch(conn, query, (name, "h1", 30.0, None, 0.0, True, 1.0), libpq=True)
            assert row[0][0][0] is True
        assert _prepared(conn) == 0
        assert _conn.state_for(conn).prepared == set()
