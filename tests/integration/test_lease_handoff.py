"""How a handed-over lease grant reaches its waiter in this process (revision pglock_0004):
a release on one pool wakes a waiter on another pool directly, and pools made with the same
settings share one NOTIFY listener. Heartbeats are pushed out of the way (HEARTBEAT and
LIVENESS 30 s), so a grant can only come from the path under test within the timeout."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool
from test_lease_support import lease_database, wait_until

import pglock
from pglock import _lease, _waiting

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def hdb(pg_dsn: str) -> Iterator[str]:
    with lease_database(pg_dsn) as d:
        yield d


@pytest.fixture
def pools(hdb: str, app_name: str) -> Iterator[list[ConnectionPool[Any]]]:
    made = [
        ConnectionPool(hdb, min_size=1, max_size=2, kwargs={"application_name": app_name},
                       open=True)
        for _ in range(2)
    ]
    yield made
    _lease.shutdown()
    for p in made:
        p.close()


@pytest.fixture
def admin(hdb: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(hdb, autocommit=True) as c:
        yield c


@pytest.fixture(autouse=True)
def no_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lease, "HEARTBEAT", 30.0)
    monkeypatch.setattr(_lease, "LIVENESS", 30.0)


def queued(admin: psycopg.Connection[Any], name: str) -> list[str]:
    rows = admin.execute(
        "SELECT holder FROM pglock.lease_waiter WHERE name = %s ORDER BY id", (name,)
    ).fetchall()
    return [r[0] for r in rows]


def listeners(admin: psycopg.Connection[Any], app_name: str) -> int:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
        " AND query ILIKE 'LISTEN%%'", (app_name,)
    ).fetchone()
    return int(row[0]) if row else 0


def start_waiting(lease: pglock.Lease, got: dict[str, Any]) -> threading.Thread:
    t = threading.Thread(target=lambda: got.setdefault("ok", lease.acquire(timeout=10)))
    t.start()
    return t


def test_a_release_on_one_pool_wakes_a_waiter_on_another_pool(
    pools: list[ConnectionPool[Any]], admin: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_waiting.waiters, "on_notify", lambda *args: None)  # no NOTIFY path
    name = f"handoff:{uuid.uuid4()}"
    holder = pglock.lease(pools[0], name, ttl=30)
    assert holder.acquire(timeout=0)
    waiter = pglock.lease(pools[1], name, ttl=30)
    got: dict[str, Any] = {}
    t = start_waiting(waiter, got)
    try:
        assert wait_until(lambda: queued(admin, name) == [waiter.holder], 10)
        holder.release()
        t.join(15)
        assert got.get("ok") is True
        assert waiter.token is not None and holder.token is not None
        assert waiter.token > holder.token
    finally:
        waiter.close()
        t.join(15)
        if waiter.locked:
            waiter.release()


def test_pools_with_the_same_settings_share_one_listener(
    pools: list[ConnectionPool[Any]], admin: psycopg.Connection[Any], app_name: str
) -> None:
    # Held by a session outside pglock, so that only a NOTIFY can bring the grants.
    names = [f"shared:{uuid.uuid4()}" for _ in range(2)]
    tokens = [
        admin.execute("SELECT token FROM pglock.acquire_v4(%s, 'outside', 30, NULL, 0, true, 1)",
                      (n,)).fetchone()
        for n in names
    ]
    waiters = [pglock.lease(p, n, ttl=30) for p, n in zip(pools, names, strict=True)]
    got: list[dict[str, Any]] = [{}, {}]
    threads = []
    try:
        for w, g, n in zip(waiters, got, names, strict=True):
            threads.append(start_waiting(w, g))
            assert wait_until(lambda n=n, w=w: queued(admin, n) == [w.holder], 10)
        assert listeners(admin, app_name) == 1
        # The second pool's waiter gets its grant through the listener the first pool opened.
        for n, tok in reversed(list(zip(names, tokens, strict=True))):
            assert tok is not None
            admin.execute("SELECT pglock.release_v4(%s, 'outside', %s)", (n, tok[0]))
        for t in threads:
            t.join(15)
        assert [g.get("ok") for g in got] == [True, True]
    finally:
        for w, t in zip(waiters, threads, strict=False):
            w.close()
            t.join(15)
            if w.locked:
                w.release()
