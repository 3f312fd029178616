"""Attack axis (a), session settings: ``exit_on_error``.

The threat model promises that no setting a role, a database or the DSN can set changes an
answer, and that ``exit_on_error`` is turned off "so that a wait that runs out does not end the
session (and every lock of it)". ``exit_on_error = on`` turns *every* ERROR into FATAL, also one
caught by a PL/pgSQL ``EXCEPTION`` block, and pglock only turns it off around a lock statement
that has a timeout. So:

* the name-registry ``DO`` block, which "swallows every error", ends the session instead when
  its INSERT fails (a concurrent uncommitted registration of the key: its 1 ms lock_timeout; a
  read-only caller transaction);
* a cancel (``close()``) or a deadlock of a wait without timeout ends the session.

Each ends the caller's session: every lock it held is gone while its handles still say locked.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from _review import backend_waiting, held_keys, in_thread, wait_until

import pglock
from pglock import _registry

pytestmark = pytest.mark.timeout(60)

EOE = "-c exit_on_error=on"
FINDING_1 = "review finding 1: exit_on_error=on ends the session (and every lock of it)"


def _name() -> str:
    return f"review:{uuid.uuid4()}"


def test_registry_insert_conflict_under_exit_on_error_keeps_the_session(
    installed: str, connect: Any
) -> None:
    """Another session registered the name in its still-open transaction (what pglock does for a
    lock taken inside a caller's transaction). A pg_lock(timeout=None) of that name by a fresh
    process whose role has exit_on_error=on must be granted and leave its other locks alone.

    Seen instead: the registry INSERT waits 1 ms, its lock_timeout error becomes FATAL, pg_lock
    raises LockNotAcquired (a TimeoutError, for a wait without timeout) and the session is gone,
    with the other lock ``keep`` that its handle still reports as held."""
    name, keep = _name(), _name()
    p1 = connect(autocommit=False)
    p1.execute("SELECT 1")  # the caller's transaction is open
    with pglock.pg_lock(p1, name):  # registers `name` inside p1's open transaction
        pass
    assert p1.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    _registry.clear()  # what a second process sees: it has not registered `name` yet

    p2 = connect(options=EOE)
    held = pglock.pg_lock(p2, keep)
    assert held.acquire()
    try:
        with pglock.pg_lock(p2, name):
            assert held_keys(installed, [pglock.key(name)])
    finally:
        p1.rollback()
        state = (p2.closed, held.locked, held_keys(installed, [pglock.key(keep)]))
        if not p2.closed:
            held.release()
    assert state[0] is False, f"pglock ended the session (closed, keep.locked, pg_locks): {state}"


def test_registry_in_a_read_only_transaction_under_exit_on_error_keeps_the_session(
    installed: str, connect: Any
) -> None:
    """A session lock taken inside the caller's READ ONLY transaction (legal: advisory locks
    write nothing). The registry INSERT is refused (25006), which the DO block is meant to
    swallow; under exit_on_error it is FATAL: pg_lock raises ReadOnlySqlTransaction and the
    session is gone with ``keep``."""
    name, keep = _name(), _name()
    c = connect(autocommit=False, options=EOE)
    held = pglock.pg_lock(c, keep)
    assert held.acquire()
    c.read_only = True
    c.execute("SELECT 1")  # a read-only transaction of the caller's
    error: BaseException | None = None
    try:
        with pglock.pg_lock(c, name):
            pass
    except Exception as exc:
        error = exc
    alive = not c.closed
    if alive:
        c.rollback()
        held.release()
    assert alive and error is None, (
        f"pg_lock raised {error!r}; session closed={c.closed}; keep.locked={held.locked}; "
        f"keep in pg_locks: {held_keys(installed, [pglock.key(keep)])}"
    )


def test_xact_lock_registry_conflict_under_exit_on_error_keeps_the_session(
    installed: str, connect: Any
) -> None:
    """The same with xact_lock: the registration runs after pglock's savepoint is released, in
    the caller's transaction, with the caller's exit_on_error. The caller's transaction (and
    session) are lost."""
    name, keep = _name(), _name()
    p1 = connect(autocommit=False)
    p1.execute("SELECT 1")
    pglock.xact_lock(p1, name, shared=True)  # registers `name`, uncommitted
    _registry.clear()
    p2 = connect(autocommit=False, options=EOE)
    held = pglock.pg_lock(p2, keep)
    assert held.acquire()
    p2.execute("SELECT 1")
    error: BaseException | None = None
    try:
        pglock.xact_lock(p2, name, shared=True)  # shared: granted beside p1's
    except Exception as exc:
        error = exc
    p1.rollback()
    alive = not p2.closed
    if alive:
        p2.rollback()
        held.release()
    assert alive and error is None, f"xact_lock raised {error!r}; session closed={p2.closed}"


def test_close_of_a_wait_under_exit_on_error_keeps_what_is_held(
    installed: str, connect: Any
) -> None:
    """docs/locks.md: close() makes a blocked acquire() return False "with nothing left held.
    What the object already holds stays held". Under exit_on_error the cancel (57014) is FATAL:
    acquire() returns False, and the session (with the lock ``keep`` of another handle) is
    gone; ``keep.locked`` still says True."""
    wanted, keep = _name(), _name()
    c = connect(options=EOE)
    holder = connect()
    held = pglock.pg_lock(c, keep)
    assert held.acquire()
    other = pglock.pg_lock(holder, wanted)
    assert other.acquire()
    with pglock.pg_lock(c, _name()):  # registry and probe done: the wait is one statement
        pass
    lock = pglock.pg_lock(c, wanted)
    t, out = in_thread(lock.acquire)
    assert wait_until(lambda: backend_waiting(installed, c.info.backend_pid))
    lock.close()
    t.join(10)
    other.release()
    state = (out, c.closed, held.locked, held_keys(installed, [pglock.key(keep)]))
    if not c.closed:
        held.release()
    assert out.get("result") is False
    assert state[1] is False, f"close() ended the session: {state}"


def test_deadlock_victim_under_exit_on_error_keeps_its_session(
    installed: str, connect: Any
) -> None:
    """docs/guarantees.md, "Deadlocks end": the victim gets DeadlockDetected "and holds nothing
    new". Under exit_on_error the 40P01 is FATAL: the victim's session ends and every lock it
    held before (``keep``) is gone."""
    x, y, keep = _name(), _name(), _name()
    a = connect()
    b = connect(options=EOE + " -c deadlock_timeout=100ms")
    hk = pglock.pg_lock(b, keep)
    assert hk.acquire()
    hx = pglock.pg_lock(a, x)
    hy = pglock.pg_lock(b, y)
    assert hx.acquire() and hy.acquire()
    ay = pglock.pg_lock(a, y)
    t, out = in_thread(ay.acquire)  # a waits for y (b holds it)
    assert wait_until(lambda: backend_waiting(installed, a.info.backend_pid))
    error: BaseException | None = None
    try:
        pglock.pg_lock(b, x).acquire()  # b waits for x: b is the victim (shorter timeout)
    except Exception as exc:
        error = exc
    t.join(10)
    assert isinstance(error, pglock.DeadlockDetected), error
    alive = not b.closed
    if alive:
        hy.release()
        hk.release()
    t.join(10)
    if out.get("result"):
        ay.release()
    hx.release()
    assert alive, f"the victim's session ended; keep.locked={hk.locked}"


FINDING_10 = "review finding 10: the session's statement_timeout cuts pglock's own statements"


def test_a_short_statement_timeout_does_not_fail_a_wait_without_timeout(
    installed: str, connect: Any
) -> None:
    """docs/guarantees.md: "A session's own statement_timeout does not shorten a longer wait that
    was asked for"; the threat model: every *timeout is overridden for pglock's waits. With
    statement_timeout=1ms from the role/DSN, the first pg_lock(timeout=None) on a connection
    raises LockNotAcquired (a TimeoutError) every time: the once-per-connection probe (a
    catalog lookup, ~4 ms cold here) is cut by the session's statement_timeout, and the 57014
    is translated as if it were pglock's own lock timeout."""
    c = connect(options="-c statement_timeout=1ms")
    name = _name()
    with pglock.pg_lock(c, name):
        assert held_keys(installed, [pglock.key(name)])


def test_a_statement_timeout_set_later_leaves_nothing_held_after_release(
    installed: str, connect: Any
) -> None:
    """docs/how-it-works.md: "a session that sets them later is found out when one of them cuts
    a wait short, and the wait is sent once more with the override". Here the session sets
    statement_timeout=1ms after its first lock; a pg_lock of 300 names is then cut partway (some
    keys granted), its clean-up (unlock_if_held, under the same statement_timeout) is cut too and
    only logged, and the retry takes every key again (a second count on the granted ones).
    acquire() returns True, release() returns normally, and pg_locks still shows the keys the
    first attempt got: held by this session until it ends, though pglock says released."""
    c = connect()
    with pglock.pg_lock(c, _name()):  # the probe runs with the default settings
        pass
    c.execute("SET statement_timeout = '1ms'")
    names = [_name() for _ in range(300)]
    keys = [pglock.key(n) for n in names]
    lock = pglock.pg_lock(c, names)
    assert lock.acquire()
    lock.release()
    left = held_keys(installed, keys)
    if left:
        c.execute("SET statement_timeout = 0")
        c.execute("SELECT pg_advisory_unlock_all()")  # clean up what pglock left
    assert left == [], f"{len(left)} of {len(keys)} keys still held after release()"


def test_a_lease_acquire_behind_a_guard_under_exit_on_error_returns_false(
    installed: str, connect: Any, app_name: str
) -> None:
    """The same root cause in the installed PL/pgSQL (lease functions on pglock's own
    connections, where the *role's* exit_on_error applies): acquire() of an expired lease whose
    old holder still guards it must return False at its timeout (docs/locks.md). The function's
    ``EXCEPTION WHEN lock_not_available`` becomes FATAL: the connection dies, pglock sends the
    statement once more on a new one, which dies the same way, and acquire() raises
    psycopg.errors.LockNotAvailable."""
    from psycopg.conninfo import make_conninfo

    from pglock import _lease

    name = _name()
    plain = make_conninfo(installed, application_name=app_name)
    eoe = make_conninfo(installed, application_name=app_name, options=EOE)
    old = pglock.lease(plain, name, ttl=1, keepalive=False)
    assert old.acquire()
    guard = connect(autocommit=False)
    outcome: Any = None
    try:
        with guard.transaction():
            old.guard(guard)
            time.sleep(1.2)  # expired, still guarded until this transaction ends
            new = pglock.lease(eoe, name, ttl=5)
            try:
                outcome = new.acquire(timeout=0.5)
            except Exception as exc:
                outcome = exc
        if outcome is True:
            new.release()
    finally:
        _lease.shutdown()
    assert outcome is False, f"acquire(timeout=0.5) behind a guard: {outcome!r}"
