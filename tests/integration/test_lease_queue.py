"""The lease waiter queue (revision pglock_0004): FIFO across processes, direct handoff (the
release statement, and the waiter's wait_v4 that confirms it; no retry), a dead head skipped
within the liveness bound, no rows left behind, and a handoff committed durably."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from test_lease_support import lease_database, wait_until, with_app

import pglock
from pglock import _lease

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

# A waiter process: queue for the lease, record (holder, token) when granted, hold a moment.
WAITER = textwrap.dedent(
    """
    import sys, time, psycopg, pglock
    dsn, name, holder, hold = sys.argv[1:5]
    with pglock.lease(dsn, name, ttl=30, timeout=60, holder=holder) as lease:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("INSERT INTO granted (holder, token) VALUES (%s, %s)",
                      (holder, lease.token))
        time.sleep(float(hold))
    """
)


@pytest.fixture(scope="module")
def qdb(pg_dsn: str) -> Iterator[str]:
    with lease_database(pg_dsn) as d:
        with psycopg.connect(d, autocommit=True) as c:
            c.execute("CREATE TABLE granted (holder text, token bigint, at timestamptz"
                      " DEFAULT clock_timestamp())")
        yield d


@pytest.fixture
def dsn(qdb: str, app_name: str) -> Iterator[str]:
    yield with_app(qdb, app_name)
    _lease.shutdown()


@pytest.fixture
def admin(qdb: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(qdb, autocommit=True) as c:
        yield c


@pytest.fixture
def name() -> str:
    return f"queue:{uuid.uuid4()}"


def queued(admin: psycopg.Connection[Any], name: str) -> list[str]:
    """The holders queued for ``name``, in FIFO order."""
    rows = admin.execute(
        "SELECT holder FROM pglock.lease_waiter WHERE name = %s ORDER BY id", (name,)
    ).fetchall()
    return [r[0] for r in rows]


def spawn(dsn: str, name: str, holder: str, hold: float = 0.0) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", WAITER, dsn, name, holder, str(hold)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(procs: list[subprocess.Popen[str]]) -> None:
    """Wait for each process to exit by itself, successfully."""
    for p in procs:
        try:
            _, err = p.communicate(timeout=60)
        finally:
            reap([p])
        assert p.returncode == 0, err


def reap(procs: list[subprocess.Popen[str]]) -> None:
    """Kill what still runs and close the pipes."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        if p.stdout is not None and not p.stdout.closed:
            p.communicate(timeout=10)


def test_waiters_of_many_processes_are_granted_in_arrival_order(
    dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    first = pglock.lease(dsn, name, ttl=30)
    first.acquire()
    holders = [f"w{i:02d}-{uuid.uuid4().hex[:8]}" for i in range(12)]
    procs = []
    try:
        for i, h in enumerate(holders):
            procs.append(spawn(dsn, name, h))
            # Each one is queued before the next starts: the arrival order is known.
            assert wait_until(lambda i=i: len(queued(admin, name)) == i + 1, 30), i
        assert queued(admin, name) == holders
        first.release()
        finish(procs)
    finally:
        reap(procs)
    rows = admin.execute(
        "SELECT holder FROM granted WHERE holder = ANY(%s) ORDER BY token", (holders,)
    ).fetchall()
    assert [r[0] for r in rows] == holders
    assert queued(admin, name) == []


def test_a_handoff_costs_the_release_and_no_retry(pg_dsn: str, app_name: str) -> None:
    # Function calls counted by the server (track_functions) in a database of the test's own;
    # the counts are flushed when the backends exit.
    name = f"handoff:{uuid.uuid4()}"
    with lease_database(pg_dsn) as bare:
        dsn = make_conninfo(with_app(bare, app_name), options="-c track_functions=all")
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CREATE TABLE granted (holder text, token bigint, at timestamptz)")
        first = pglock.lease(dsn, name, ttl=30)
        first.acquire()
        holders = [f"p{i}-{uuid.uuid4().hex[:8]}" for i in range(6)]
        procs = []
        with psycopg.connect(dsn, autocommit=True) as admin:
            for i, h in enumerate(holders):
                procs.append(spawn(dsn, name, h, hold=0.01))
                assert wait_until(lambda i=i: len(queued(admin, name)) == i + 1, 30)
        first.release()
        finish(procs)
        _lease.shutdown()
        with psycopg.connect(bare, autocommit=True) as c:
            calls = dict(c.execute(
                "SELECT funcname, calls FROM pg_stat_user_functions WHERE schemaname = 'pglock'"
            ).fetchall())
    # 7 grants: the first (acquire_v4's own grant of a free name nobody queues for, without
    # the old acquire path) and 6 handoffs. Each waiter queued once (one acquire_v4 each) and
    # was never asked to try again; each grant ended with one release, which handed the lease
    # on; the last one, with nobody queued (the row's waiters flag false), never looked at the
    # queue.
    assert calls.get("acquire_v4") == 7, calls
    assert calls.get("acquire", 0) == 0, calls
    assert calls.get("release_v4") == 7, calls
    assert calls.get("hand_over_v4") == 6, calls
    assert calls.get("release", 0) == 0 and calls.get("extend", 0) == 0, calls


def test_a_killed_head_is_skipped_within_the_liveness_bound(
    dsn: str, admin: psycopg.Connection[Any], name: str, record_property: Any
) -> None:
    first = pglock.lease(dsn, name, ttl=30)
    first.acquire()
    head, second = f"head-{uuid.uuid4().hex[:8]}", f"next-{uuid.uuid4().hex[:8]}"
    procs = [spawn(dsn, name, head)]
    try:
        assert wait_until(lambda: queued(admin, name) == [head], 30)
        procs.append(spawn(dsn, name, second, hold=3))
        assert wait_until(lambda: queued(admin, name) == [head, second], 30)
        os.kill(procs[0].pid, signal.SIGKILL)
        reap(procs[:1])
        first.release()  # the head's row still looks alive: it may be handed the lease
        released = time.monotonic()

        def holder() -> Any:
            row = admin.execute(
                "SELECT holder FROM pglock.lease WHERE name = %s"
                " AND expires_at > clock_timestamp()", (name,)
            ).fetchone()
            return row is not None and row[0] == second

        assert wait_until(holder, 5)
        took = time.monotonic() - released
        record_property("lease_queue_dead_head_stall_s", took)
        # The bound (a fault oracle, not a speed target): liveness + handoff window + a beat.
        assert took < 2.0, took
        finish(procs[1:])
    finally:
        reap(procs)


def test_try_lock_never_queues_and_never_passes_a_live_queue(
    dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    first = pglock.lease(dsn, name, ttl=1, keepalive=False)
    first.acquire()
    assert not pglock.lease(dsn, name, ttl=5).acquire(timeout=0)
    assert queued(admin, name) == []
    got: dict[str, Any] = {}
    waiter = pglock.lease(dsn, name, ttl=5)

    def wait() -> None:
        got["ok"] = waiter.acquire(timeout=10)

    t = threading.Thread(target=wait)
    t.start()
    assert wait_until(lambda: queued(admin, name) == [waiter.holder], 10)
    # The first lease expires with the waiter queued: a try-lock does not take it.
    while first.locked:
        time.sleep(0.01)
    time.sleep(0.05)
    assert not pglock.lease(dsn, name, ttl=5).acquire(timeout=0)
    t.join(10)
    assert got.get("ok") is True
    assert waiter.token is not None and first.token is not None and waiter.token > first.token
    waiter.release()


def test_a_timed_out_or_closed_waiter_leaves_no_row(
    dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    with pglock.lease(dsn, name, ttl=30):
        assert not pglock.lease(dsn, name, ttl=5).acquire(timeout=0.5)
        assert queued(admin, name) == []
        waiter = pglock.lease(dsn, name, ttl=5)
        got: dict[str, Any] = {}
        t = threading.Thread(target=lambda: got.setdefault("ok", waiter.acquire(timeout=30)))
        t.start()
        assert wait_until(lambda: queued(admin, name) == [waiter.holder], 10)
        waiter.close()
        t.join(10)
        assert got.get("ok") is False
        assert queued(admin, name) == []


def test_a_grant_arrives_by_heartbeat_without_notify(
    dsn: str, admin: psycopg.Connection[Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As through PgBouncer (no LISTEN): the waiter's heartbeat is its poll.
    from pglock import _waiting

    monkeypatch.setattr(_waiting, "listen", lambda *args: None)
    monkeypatch.setattr(_waiting.waiters, "on_notify", lambda *args: None)
    holder = pglock.lease(dsn, name, ttl=30)
    holder.acquire()
    other = f"other-{uuid.uuid4().hex[:8]}"
    procs = [spawn(dsn, name, other, hold=0)]
    try:
        assert wait_until(lambda: queued(admin, name) == [other], 30)
        waiter = pglock.lease(dsn, name, ttl=5)
        got: dict[str, Any] = {}
        t = threading.Thread(target=lambda: got.setdefault("ok", waiter.acquire(timeout=20)))
        t.start()
        assert wait_until(lambda: queued(admin, name) == [other, waiter.holder], 10)
        holder.release()  # to the other process, which releases to this waiter at once
        t.join(20)
        assert got.get("ok") is True
        waiter.release()
        finish(procs)
    finally:
        reap(procs)


def test_a_release_that_hands_over_commits_durably(
    admin: psycopg.Connection[Any], name: str
) -> None:
    def release_sees(holder: str, token: int) -> str:
        with admin.transaction():
            admin.execute("SELECT * FROM pglock.release_v4(%s, %s, %s)", (name, holder, token))
            row = admin.execute("SELECT current_setting('synchronous_commit')").fetchone()
        assert row is not None
        return str(row[0])

    def acquire(holder: str) -> Any:
        return admin.execute(
            "SELECT granted, token, waiter_id FROM pglock.acquire_v4(%s, %s, 30, NULL, 5,"
            " true, 5)", (name, holder),
        ).fetchone()

    default = admin.execute("SELECT current_setting('synchronous_commit')").fetchone()
    assert default is not None and default[0] != "off"
    granted, token, _ = acquire("a")
    assert granted
    granted, _, waiter = acquire("b")
    assert not granted and waiter is not None
    # Handed to b in the same transaction: a grant, committed with the server's setting.
    assert release_sees("a", token) == default[0]
    row = admin.execute("SELECT holder, token FROM pglock.lease WHERE name = %s", (name,))
    b_holder, b_token = row.fetchone() or (None, None)
    assert b_holder == "b" and b_token > token
    # Nobody queued: an ordinary release, committed without waiting for the flush.
    assert release_sees("b", b_token) == "off"
