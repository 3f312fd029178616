"""Interrupts and close() racing a wait."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from typing import Any

import pytest
from _review import DelayingProxy, backend_waiting, held_keys, in_thread, wait_until
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pglock

pytestmark = pytest.mark.timeout(60)


def _name() -> str:
    return f"review:{uuid.uuid4()}"


def test_an_interrupt_right_after_the_grant_leaves_nothing_held(
    installed: str, connect: Any
) -> None:
    """docs/guarantees.md: "A timeout, a cancel or a Ctrl-C leaves nothing held". PgLock._acquire
    says "No calls between the grant and recording it", but it calls threading.current_thread()
    there. A SIGINT whose handler runs at that call (injected here with a trace function that
    raises KeyboardInterrupt exactly there, the way a signal handler would) leaves the lock held
    by the session and recorded for this thread, with no handle: `with` propagates the
    interrupt without releasing, and every later `with pg_lock(conn, name)` of this thread is a
    counted re-entry that never unlocks. The lock stays held until the session ends."""
    c = connect()
    name = _name()
    current_thread = threading.current_thread.__code__

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        back = frame.f_back
        if (
            event == "call" and frame.f_code is current_thread and back is not None
            and back.f_code.co_name == "_acquire"
            and back.f_code.co_filename.endswith("_advisory.py")
        ):
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(tracer)
    try:
        with pglock.pg_lock(c, name):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    after_interrupt = held_keys(installed, [pglock.key(name)])
    with pglock.pg_lock(c, name):  # a later, complete with-block
        pass
    after_cycle = held_keys(installed, [pglock.key(name)])
    if after_cycle:
        c.execute("SELECT pg_advisory_unlock_all()")  # clean up the leak
    assert after_interrupt == [] and after_cycle == [], (after_interrupt, after_cycle)


def test_a_grant_that_arrives_after_close_is_given_back(
    installed: str, connect: Any, app_name: str
) -> None:
    """docs/locks.md: "a grant that arrives after close() marked the wait closed is given back,
    and acquire() returns False" (close(): acquire "returns False ... with nothing left held").
    With a cancel that takes 1 s to reach the server (slow link), close() marks the wait closed,
    the lock is granted 0.2 s later, and PgLock.acquire() returns True, holding it (PoolLock does
    give such a grant back)."""
    params = conninfo_to_dict(installed)
    proxy = DelayingProxy(params.get("host", "127.0.0.1"), int(params.get("port", 5432)), 1.0)
    try:
        dsn = make_conninfo(
            installed, host="127.0.0.1", port=proxy.port, sslmode="disable",
            gssencmode="disable", application_name=app_name,
        )
        import psycopg

        c = psycopg.connect(dsn, autocommit=True)
        holder = connect()
        name = _name()
        with pglock.pg_lock(c, name):
            pass
        hold = pglock.pg_lock(holder, name)
        assert hold.acquire()
        lock = pglock.pg_lock(c, name)
        t, out = in_thread(lock.acquire)
        assert wait_until(lambda: backend_waiting(installed, c.info.backend_pid))
        threading.Thread(target=lock.close, daemon=True).start()
        time.sleep(0.2)
        hold.release()
        t.join(10)
        result = out.get("result")
        if lock.locked:
            lock.release()
        c.close()
    finally:
        proxy.close()
    assert result is False, f"acquire() after close() returned {out}"
