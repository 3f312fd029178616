"""One holder id per semaphore acquisition (issue 14, item 4), on the SQL side: sent again, an
acquire that committed fails on its own (semaphore, holder) key and changes nothing else, and a
waiting acquisition's attempts share one holder id and send nothing more when no answer was lost.
The faults themselves (lost answers) are in tests/faults/test_orphans.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import own_schema
from psycopg import sql
from psycopg_pool import ConnectionPool

import pglock
from pglock import _semaphore, _sql


@pytest.fixture(scope="module")
def schema(pg_dsn: str) -> Iterator[str]:
    with own_schema(pg_dsn, prefix="t14req") as name:
        yield name


@pytest.fixture
def pool(pg_dsn: str) -> Iterator[ConnectionPool[Any]]:
    p: ConnectionPool[Any] = ConnectionPool(pg_dsn, min_size=1, max_size=4,
                                            kwargs={"autocommit": True}, open=True)
    try:
        yield p
    finally:
        p.close()


def acquire(conn: psycopg.Connection[Any], schema: str, name: str, holder: str, *, limit: int,
            permits: int = 1, ttl: float = 60.0, wait: bool = False) -> Any:
    """pglock's own acquire batch (BEGIN ...; SELECT semaphore_acquire(...); COMMIT)."""
    cur = conn.execute(_sql.semaphore_acquire(schema, name, limit, holder, permits, ttl, None,
                                              wait))
    while cur.description is None:
        assert cur.nextset()
    return cur.fetchone()


def state(conn: psycopg.Connection[Any], schema: str, name: str) -> tuple[Any, ...]:
    s = sql.Identifier(schema)
    rows = conn.execute(sql.SQL("SELECT holder, permits, expires_at FROM {}.semaphore_permit"
                                " WHERE semaphore = %s ORDER BY holder").format(s),
                        (name,)).fetchall()
    flag = conn.execute(sql.SQL("SELECT waiters FROM {}.semaphore WHERE name = %s").format(s),
                        (name,)).fetchone()
    return rows, flag


def test_an_acquire_sent_again_with_its_holder_id_changes_nothing(
    conn: psycopg.Connection[Any], schema: str, name: str,
) -> None:
    """What the client relies on to adopt a grant it did not hear about: the repeated acquire
    fails with unique_violation, and its transaction rolls back whole (the expired row it
    deleted first is back, the waiters flag and the live row's expiry unchanged)."""
    mine, expired, waiter = (f"{who}:{uuid.uuid4().hex}" for who in ("mine", "gone", "waiter"))
    assert acquire(conn, schema, name, mine, limit=2)[0] is True
    assert acquire(conn, schema, name, waiter, limit=2, permits=2, wait=True)[0] is False
    assert acquire(conn, schema, name, expired, limit=2, ttl=0.001)[0] is True
    deadline = time.monotonic() + 10  # the 1 ms permit past its expiry on the database clock
    while conn.execute(sql.SQL("SELECT count(*) FROM {}.semaphore_permit WHERE holder = %s AND"
                               " expires_at > clock_timestamp()").format(sql.Identifier(schema)),
                       (expired,)).fetchone() != (0,):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = state(conn, schema, name)
    assert [r[0] for r in before[0]] == sorted([mine, expired]) and before[1] == (True,)
    with pytest.raises(psycopg.errors.UniqueViolation):
        acquire(conn, schema, name, mine, limit=2)  # room for one more: it reaches the INSERT
    conn.rollback()
    assert state(conn, schema, name) == before
    # Without the repeat, the same call deletes the expired row (the rollback above undid it).
    other = f"other:{uuid.uuid4().hex}"
    assert acquire(conn, schema, name, other, limit=2)[0] is True
    assert [r[0] for r in state(conn, schema, name)[0]] == sorted([mine, other])
    for holder in (mine, other):
        conn.execute(sql.SQL("SELECT {}.semaphore_release(%s, %s)").format(
            sql.Identifier(schema)), (name, holder))


def test_a_waiting_acquisition_uses_one_holder_id_and_nothing_more(
    pool: ConnectionPool[Any], conn: psycopg.Connection[Any], schema: str, name: str,
    statements: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused attempts whose answers all arrived: one holder id for all of them, no renewal
    to look for an unseen grant and no release when the acquisition gives up."""
    sent: list[str] = []
    build = _sql.semaphore_acquire

    def spy(schema: str, name: str, limit: int, holder: str, *args: Any) -> Any:
        sent.append(holder)
        return build(schema, name, limit, holder, *args)

    rival = f"rival:{uuid.uuid4().hex}"  # held from SQL: its statements are not counted
    assert acquire(conn, schema, name, rival, limit=1)[0] is True
    monkeypatch.setattr(_semaphore._sql, "semaphore_acquire", spy)
    sem = pglock.semaphore(pool, name, 1, schema=schema)
    try:
        # Refused, then refused again once its LISTEN is active (a second look), then timed out.
        assert sem.acquire(timeout=1.0) is False
        assert len(sent) >= 2 and len(set(sent)) == 1, sent
        assert statements["semaphore_acquire"] == len(sent)
        assert statements["semaphore_release"] == 0 and statements["semaphore_extend"] == 0
        conn.execute(sql.SQL("SELECT {}.semaphore_release(%s, %s)").format(
            sql.Identifier(schema)), (name, rival))
        assert sem.acquire(timeout=5)
        assert sent[-1] != sent[0]  # a new acquisition, a new holder id
        sem.release()
    finally:
        sem.close()
