"""Process lifecycle: garbage collection (docs/locks.md, "Garbage collection").

A held ``pg_lock`` handle that is collected without release leaves no record that lies: its hold
becomes an unlock deferred to the connection's next lock statement, so neither its own thread
(which would re-enter a count nobody drops) nor another thread of the connection (which would
wait for ever) believes in it. Held leases and permits are kept alive by the keepalive: dropping
the handle does not end them (documented).
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from _truth import held

import pglock


def test_collected_handle_leaves_no_hold(
    conn: psycopg.Connection[Any], other: psycopg.Connection[Any], name: str
) -> None:
    """The same thread takes the name again after its handle was collected: Postgres grants it
    anew, and the release leaves nothing held."""
    lock = pglock.pg_lock(conn, name)
    assert lock.acquire()
    del lock
    gc.collect()
    again = pglock.pg_lock(conn, name)
    assert again.acquire(timeout=0)
    again.release()
    assert held(other, conn.info.backend_pid) == []


@pytest.mark.parametrize("shared", [False, True])
def test_collected_handle_does_not_block_other_threads(
    conn: psycopg.Connection[Any], other: psycopg.Connection[Any], name: str, shared: bool
) -> None:
    lock = pglock.pg_lock(conn, name, shared=shared)
    assert lock.acquire()
    del lock
    gc.collect()
    got: list[bool] = []

    def take() -> None:
        mine = pglock.pg_lock(conn, name)
        got.append(mine.acquire(timeout=0))
        if got[-1]:
            mine.release()

    t = threading.Thread(target=take)
    t.start()
    t.join(30)
    assert got == [True]
    assert held(other, conn.info.backend_pid) == []


def test_collected_handle_does_not_block_a_transaction_lock(
    connect: Any, other: psycopg.Connection[Any], name: str
) -> None:
    conn = connect(autocommit=False)
    lock = pglock.pg_lock(conn, name)
    assert lock.acquire()
    del lock
    gc.collect()
    got: list[bool] = []

    def take() -> None:
        got.append(pglock.try_xact_lock(conn, name))
        conn.commit()

    t = threading.Thread(target=take)
    t.start()
    t.join(30)
    assert got == [True]
    with pglock.pg_lock(conn, f"{name}:next"):  # the deferred unlock goes out first
        assert [k for k, _ in held(other, conn.info.backend_pid)] == [pglock.key(f"{name}:next")]
    assert held(other, conn.info.backend_pid) == []


@pytest.mark.parametrize("what", ["lease", "permit"])
def test_dropped_ttl_handle_stays_held_until_the_process_ends(dsn: str, what: str) -> None:
    """Documented: the keepalive keeps a held Lease (or Permit) alive, so dropping the handle
    does not end it; it is renewed on (until released, or the process exits)."""
    name = f"gc:{uuid.uuid4()}"
    handle: Any
    if what == "lease":
        handle = pglock.lease(dsn, name, ttl=1.0)
        assert handle.acquire()
    else:
        handle = pglock.semaphore(dsn, name, 1, ttl=1.0).hold().__enter__()
    handle_id = id(handle)
    del handle
    gc.collect()
    with psycopg.connect(dsn, autocommit=True, application_name="pglock-checker") as obs:

        def expiry() -> Any:
            if what == "lease":
                info = pglock.lease_info(obs, name)
                return None if info is None else info.expires_at
            holders = [h for s in pglock.semaphores(obs, name) for h in s.holders]
            return holders[0].expires_at if holders else None

        first = expiry()
        assert first is not None
        deadline = time.monotonic() + 20
        while (now := expiry()) == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert now is not None and now > first, "the dropped handle was not renewed"
    kept = [h for h in pglock._keepalive.scheduler.held if id(h) == handle_id]
    assert len(kept) == 1
    kept[0].release()
