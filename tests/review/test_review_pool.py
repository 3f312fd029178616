"""Pools: ``pool_lock`` / ``PoolLock.close()``, the reset hooks, SQLAlchemy."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from _review import DelayingProxy, backend_waiting, held_keys, in_thread, wait_until
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

import pglock

pytestmark = pytest.mark.timeout(60)


def _name() -> str:
    return f"review:{uuid.uuid4()}"


def test_pool_lock_close_never_cancels_the_next_borrowers_statement(
    installed: str, connect: Any, app_name: str
) -> None:
    """docs/pools.md: close() "wakes a thread blocked in acquire() at once: pglock cancels its
    waiting lock statement, the connection goes back to the pool idle with nothing held";
    docs/how-it-works.md: "The cancel can never reach another thread's statement".

    PoolLock._wake calls cancel_safe() on the connection it read from ``_waiting`` with no
    interlock against the wait ending meanwhile (PgLock's Flight has one). When the lock is
    granted while the cancel is on its way (here the network holds cancel requests for 1 s, as a
    slow link to the server does for a few ms), the PoolLock releases, gives the connection
    back, and the cancel lands on the next borrower's statement: its work fails with
    QueryCanceled, a transaction pglock did not begin."""
    params = conninfo_to_dict(installed)
    proxy = DelayingProxy(params.get("host", "127.0.0.1"), int(params.get("port", 5432)), 1.0)
    dsn = make_conninfo(
        installed, host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable",
        application_name=app_name,
    )
    holder = connect()
    name = _name()
    hold = pglock.pg_lock(holder, name)
    assert hold.acquire()
    try:
        with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
            with pool.connection() as c:
                pid = c.info.backend_pid
            lock = pglock.pool_lock(pool, name)
            t, out = in_thread(lock.acquire)  # waits: holder has it
            assert wait_until(lambda: backend_waiting(installed, pid))
            threading.Thread(target=lock.close, daemon=True).start()  # cancel now in flight
            time.sleep(0.2)
            hold.release()  # granted before the cancel arrives
            t.join(10)
            assert out.get("result") is False  # close() ran: acquire() returns False
            borrower_error: BaseException | None = None
            try:
                with pool.connection(timeout=5) as c:  # the same session, a new borrower
                    assert c.info.backend_pid == pid
                    c.execute("SELECT pg_sleep(1.5)")
            except psycopg.Error as exc:
                borrower_error = exc
            assert proxy.cancels >= 1
    finally:
        proxy.close()
    assert held_keys(installed, [pglock.key(name)]) == []
    assert borrower_error is None, f"the next borrower's statement failed: {borrower_error!r}"
