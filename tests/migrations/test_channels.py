"""The NOTIFY channels pglock LISTENs on are the ones the installed functions notify, for long
and multi-byte schema names too (the installed SQL is the source of truth)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pglock import _schema
from pglock._contract import lease_channel, semaphore_channel


def _schemas() -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [
        f"ch_{tag}",
        f"ch_{tag}_".ljust(63, "x"),  # the longest valid name: the channels are cut
        # Not a name pglock accepts, but the revisions install it: 61 bytes, 36 characters.
        f"ch{tag}_" + "é" * 25,
    ]


@pytest.fixture(params=_schemas(), ids=["short", "63 bytes", "multi-byte"])
def schema(request: pytest.FixtureRequest, pg_dsn: str) -> Iterator[str]:
    name: str = request.param
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        with c.transaction():
            for rev in _schema.revisions():
                for stmt in rev.upgrade_statements(name):
                    c.execute(stmt)
        try:
            yield name
        finally:
            c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def _notified(listener: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    return [(n.channel, n.payload) for n in listener.notifies(timeout=10, stop_after=1)]


def test_lease_release_notifies_lease_channel(pg_dsn: str, schema: str) -> None:
    s = sql.Identifier(schema)
    with psycopg.connect(pg_dsn, autocommit=True) as c, \
            psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(lease_channel(schema))))
        row = c.execute(sql.SQL("SELECT granted, token FROM {}.acquire('n', 'h1', 60)").format(s)
                        ).fetchone()
        assert row is not None and row[0]
        waiter = sql.SQL("SELECT granted FROM {}.acquire('n', 'h2', 60, NULL, 5)").format(s)
        assert c.execute(waiter).fetchone() == (False,)
        release = sql.SQL("SELECT status, notified FROM {}.release('n', 'h1', %s)").format(s)
        assert c.execute(release, (row[1],)).fetchone() == ("released", True)
        assert _notified(listener) == [(lease_channel(schema), "n")]


def test_semaphore_release_notifies_semaphore_channel(pg_dsn: str, schema: str) -> None:
    s = sql.Identifier(schema)
    with psycopg.connect(pg_dsn, autocommit=True) as c, \
            psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(semaphore_channel(schema))))
        acquire = sql.SQL("SELECT granted FROM {}.semaphore_acquire('m', 1, %s, 1, 60, NULL, true)")
        assert c.execute(acquire.format(s), ("h1",)).fetchone() == (True,)
        assert c.execute(acquire.format(s), ("h2",)).fetchone() == (False,)
        release = sql.SQL("SELECT status, notified FROM {}.semaphore_release('m', 'h1')")
        assert c.execute(release.format(s)).fetchone() == ("released", True)
        assert _notified(listener) == [(semaphore_channel(schema), "m")]
