"""Every kind of pglock object that holds something, for the fork tests (test_fork.py and the
script _fork_exit.py): how the parent takes it, what Postgres says the parent holds, and what a
forked child does with its inherited copy (``child_<action>`` methods, each asserting what the
child must see). A kind has an action when it has the method: the tests generate the table of
kinds x actions from that.

The rule under test (docs/locks.md, "Processes and fork"): a child holds nothing of what its
parent holds; it never releases, renews or uses it, nor the parent's connections; ``with`` exits
send nothing, explicit releases raise RuntimeError naming the fork; it may make its own.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import sys
import threading
import time
import traceback
import types
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg
import psycopg_pool

import pglock
from pglock import _keepalive

ChildFn = Callable[[], None]


def forked_error(fn: Callable[[], object]) -> None:
    """``fn()`` must raise the RuntimeError of a hold inherited from the parent."""
    try:
        fn()
    except RuntimeError as exc:
        assert "forked" in str(exc), f"not the fork's error: {exc!r}"
        return
    raise AssertionError(f"{fn} did not raise the fork's RuntimeError")


def not_granted(fn: Callable[[], object]) -> None:
    """``fn()`` (an acquire in the child of what the parent holds) must not grant: False, or a
    refusal before any SQL (an inherited connection, the parent's election)."""
    try:
        granted = fn()
    except pglock.InvalidConnectionState as exc:
        assert "forked" in str(exc), exc
        return
    except RuntimeError as exc:
        assert "forked" in str(exc), exc
        return
    assert granted is False, f"the child was granted what its parent holds: {granted!r}"


class Kind:
    """One holding kind. ``hold()`` takes it in the parent (as a ``with`` block's entry, whose
    exit is ``entered.__exit__``); ``truth()`` is what Postgres says the parent holds; the
    ``child_*`` methods run in a child."""

    name = "?"
    entered: Any
    #: Sessions of the parent that run statements on their own while the child runs (the
    #: leader's checks): their presence is checked, not their activity.
    busy: set[int]

    def __init__(self, dsn: str, lock_name: str) -> None:
        self.dsn = dsn
        self.lock_name = lock_name
        self.other = f"{lock_name}:child"
        self.busy = set()
        self.closers: list[Callable[[], object]] = []

    # The parent's side.
    def hold(self) -> None:
        raise NotImplementedError

    def truth(self, obs: psycopg.Connection[Any]) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """The parent's own release: must succeed and report no loss."""
        raise NotImplementedError

    def released(self, obs: psycopg.Connection[Any]) -> bool:
        """After the parent's release: Postgres shows nothing held by the parent."""
        return not self.truth(obs)

    def close(self) -> None:
        for fn in reversed(self.closers):
            with contextlib.suppress(Exception):
                fn()

    # Common child actions (a kind may replace them).
    def held_here(self) -> bool:
        raise NotImplementedError

    def child_locked(self) -> None:
        assert not self.held_here(), "the child believes it holds its parent's lock"

    def child_release(self) -> None:
        raise NotImplementedError

    def child_exit_with(self) -> None:
        self.entered.__exit__(None, None, None)

    def child_gc(self) -> None:
        """Drop every reference to what the kind made (objects, connections, pools) and let the
        garbage collector finalize them."""
        for key in list(vars(self)):
            if key not in ("dsn", "lock_name", "other", "busy"):
                setattr(self, key, None)
        gc.collect()


def advisory_truth(obs: psycopg.Connection[Any], name: str) -> list[tuple[int, str]]:
    """(pid, mode) of every session holding ``name`` (pg_locks)."""
    return obs.execute(
        "SELECT pid, mode FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
        "AND granted AND (classid::bigint << 32) | objid::bigint = %s ORDER BY 1",
        (pglock.key(name),),
    ).fetchall()


class _Advisory(Kind):
    obj: Any

    def truth(self, obs: psycopg.Connection[Any]) -> Any:
        return advisory_truth(obs, self.lock_name)

    def held_here(self) -> bool:
        return bool(self.obj.locked)

    def release(self) -> None:
        self.obj.release()

    def child_release(self) -> None:
        forked_error(self.obj.release)


class PgLockKind(_Advisory):
    """pg_lock on a connection of the caller's."""

    name = "pg_lock"

    def hold(self) -> None:
        self.conn = psycopg.connect(self.dsn, autocommit=True)
        self.closers.append(self.conn.close)
        self.obj = self.entered = pglock.pg_lock(self.conn, self.lock_name)
        self.obj.__enter__()

    def child_reacquire(self) -> None:
        not_granted(lambda: self.obj.acquire(timeout=0))

    def child_use(self) -> None:
        # The parent's connection is refused before any SQL, for every lock kind on it (the
        # transaction lock with psycopg's BEGIN still to send: autocommit off, client-side).
        self.conn.autocommit = False
        for attempt in (
            lambda: pglock.pg_lock(self.conn, self.other).acquire(timeout=0),
            lambda: pglock.try_xact_lock(self.conn, self.other),
            lambda: pglock.rwlock(self.conn, self.other).read().acquire(timeout=0),
        ):
            try:
                attempt()
            except pglock.InvalidConnectionState as exc:
                assert "forked" in str(exc)
            else:
                raise AssertionError("the child used its parent's connection")
        with psycopg.connect(self.dsn, autocommit=True) as own:
            with pglock.pg_lock(own, self.other, timeout=5):
                pass
            assert not pglock.pg_lock(own, self.lock_name).acquire(timeout=0)


class RWReadKind(PgLockKind):
    """rwlock(...).read() on a connection of the caller's."""

    name = "rwlock_read_conn"

    def hold(self) -> None:
        self.conn = psycopg.connect(self.dsn, autocommit=True)
        self.closers.append(self.conn.close)
        self.obj = self.entered = pglock.rwlock(self.conn, self.lock_name).read()
        self.obj.__enter__()


class PoolLockKind(_Advisory):
    """pool_lock on a psycopg_pool pool of the caller's (a child never uses the parent's pool:
    it makes its own, which is what child_use does)."""

    name = "pool_lock"

    def hold(self) -> None:
        self.pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            self.dsn, min_size=2, max_size=2, reset=pglock.reset_connection, open=False
        )
        self.pool.open(wait=True, timeout=10)
        self.closers.append(self.pool.close)
        self.obj = self.entered = pglock.pool_lock(self.pool, self.lock_name)
        self.obj.__enter__()

    def child_use(self) -> None:
        with psycopg_pool.ConnectionPool(self.dsn, min_size=1, max_size=1, open=True) as own:
            with pglock.pool_lock(own, self.other, timeout=5):
                pass
            assert not pglock.pool_lock(own, self.lock_name).acquire(timeout=0)


class _LockerKind(_Advisory):
    """Made through a Locker on a DSN (the Locker's own pool)."""

    def make(self, locker: pglock.Locker) -> Any:
        raise NotImplementedError

    def hold(self) -> None:
        self.locker = pglock.Locker(self.dsn)
        self.closers.append(self.locker.close)
        self.obj = self.entered = self.make(self.locker)
        self.obj.__enter__()

    def child_reacquire(self) -> None:
        not_granted(lambda: self.obj.acquire(timeout=0))

    def child_use(self) -> None:
        # The Locker opens a pool of the child's own; closing it closes only that one.
        with self.locker.lock(self.other, timeout=5):
            pass
        assert not self.locker.lock(self.lock_name).acquire(timeout=0)
        self.locker.close()


class LockerLockKind(_LockerKind):
    name = "locker_lock"

    def make(self, locker: pglock.Locker) -> Any:
        return locker.lock(self.lock_name)


class RWWriteKind(_LockerKind):
    name = "rwlock_write_locker"

    def make(self, locker: pglock.Locker) -> Any:
        return locker.rwlock(self.lock_name).write()


class SingletonKind(_LockerKind):
    name = "singleton_locker"

    def make(self, locker: pglock.Locker) -> Any:
        return locker.singleton(self.lock_name)


class _LeaseKind(Kind):
    lease: pglock.Lease

    def make(self) -> pglock.Lease:
        raise NotImplementedError

    def hold(self) -> None:
        self.lease = self.entered = self.make()
        self.lease.__enter__()

    def truth(self, obs: psycopg.Connection[Any]) -> Any:
        info = pglock.lease_info(obs, self.lock_name)
        return None if info is None else (info.holder, info.token, info.expires_in > 0)

    def release(self) -> None:
        self.lease.release()

    def held_here(self) -> bool:
        return self.lease.locked

    def child_release(self) -> None:
        forked_error(self.lease.release)

    def child_extend(self) -> None:
        forked_error(self.lease.extend)

    def child_check(self) -> None:
        forked_error(self.lease.check)

    def child_guard(self) -> None:
        with psycopg.connect(self.dsn) as own, own.transaction():
            forked_error(lambda: self.lease.guard(own))

    def child_reacquire(self) -> None:
        not_granted(lambda: self.lease.acquire(timeout=0))

    def child_use(self) -> None:
        with pglock.lease(self.dsn, self.other, ttl=60, timeout=5):
            pass
        assert not pglock.lease(self.dsn, self.lock_name).acquire(timeout=0)


class LeaseDsnKind(_LeaseKind):
    name = "lease_dsn"

    def make(self) -> pglock.Lease:
        return pglock.lease(self.dsn, self.lock_name, ttl=60)


class LeaseLockerKind(_LeaseKind):
    name = "lease_locker"

    def make(self) -> pglock.Lease:
        self.locker = pglock.Locker(self.dsn)
        self.closers.append(self.locker.close)
        return self.locker.lease(self.lock_name, ttl=60)

    def child_use(self) -> None:
        with self.locker.lease(self.other, ttl=60, timeout=5):
            pass
        assert not self.locker.lease(self.lock_name).acquire(timeout=0)
        self.locker.close()


class _HolderLease(_LeaseKind):
    """A lease with an explicit holder id. A child never acquires under a holder id of its
    parent's: its copy of the handle refuses (RuntimeError), and a new handle with that holder
    id gets HolderInUse, with ``resume=True`` too (the database would grant it the parent's
    lease, token kept, and its release would end the parent's)."""

    @property
    def holder(self) -> str:
        return f"worker:{self.lock_name}"

    def handle(self, **options: Any) -> pglock.Lease:
        return pglock.lease(self.dsn, self.lock_name, ttl=60, holder=self.holder, **options)

    def make(self) -> pglock.Lease:
        return self.handle()

    def child_same_holder(self) -> None:
        for resume in (False, True):
            try:
                self.handle(resume=resume).acquire(timeout=0)
            except pglock.HolderInUse:
                continue
            raise AssertionError(f"a new handle (resume={resume}) used the parent's holder id")


class LeaseHolderDsnKind(_HolderLease):
    name = "lease_holder_dsn"


class LeaseHolderLockerKind(_HolderLease):
    name = "lease_holder_locker"

    def handle(self, **options: Any) -> pglock.Lease:
        if not hasattr(self, "locker"):
            self.locker = pglock.Locker(self.dsn)
            self.closers.append(self.locker.close)
        return self.locker.lease(self.lock_name, ttl=60, holder=self.holder, **options)


class LeaseResumedKind(_HolderLease):
    """Held by a handle that re-attached with ``resume=True`` (taking it over from the first)."""

    name = "lease_resumed_dsn"

    def make(self) -> pglock.Lease:
        self.first = self.handle()
        assert self.first.acquire(timeout=5)
        return self.handle(resume=True)


def permit_holders(obs: psycopg.Connection[Any], name: str) -> list[str]:
    return sorted(h.holder for s in pglock.semaphores(obs, name) for h in s.holders)


class SemaphoreKind(Kind):
    """``with sem:`` (one permit, limit 1) on a DSN."""

    name = "semaphore_dsn"

    def hold(self) -> None:
        self.sem = self.entered = pglock.semaphore(self.dsn, self.lock_name, 1, ttl=60)
        self.closers.append(self.sem.close)
        self.sem.__enter__()

    def truth(self, obs: psycopg.Connection[Any]) -> Any:
        return permit_holders(obs, self.lock_name)

    def release(self) -> None:
        self.sem.release()

    def held_here(self) -> bool:
        return self.sem.locked

    def child_release(self) -> None:
        forked_error(self.sem.release)

    def child_reacquire(self) -> None:
        not_granted(lambda: self.sem.acquire(timeout=0))

    def child_use(self) -> None:
        with pglock.semaphore(self.dsn, self.other, 1, ttl=60).hold(timeout=5):
            pass
        assert not pglock.semaphore(self.dsn, self.lock_name, 1).acquire(timeout=0)
        self.sem.close()


class PermitKind(SemaphoreKind):
    """``with sem.hold() as permit:`` through a Locker's pool."""

    name = "permit_locker"

    def hold(self) -> None:
        self.locker = pglock.Locker(self.dsn)
        self.closers.append(self.locker.close)
        self.sem = self.locker.semaphore(self.lock_name, 1, ttl=60)
        self.holding = self.entered = self.sem.hold()
        self.permit = self.holding.__enter__()

    def release(self) -> None:
        self.permit.release()

    def held_here(self) -> bool:
        return self.permit.locked

    def child_release(self) -> None:
        forked_error(self.permit.release)

    def child_check(self) -> None:
        forked_error(self.permit.check)

    def child_use(self) -> None:
        with self.locker.semaphore(self.other, 1).hold(timeout=5):
            pass
        assert not self.locker.semaphore(self.lock_name, 1).acquire(timeout=0)
        self.locker.close()


class LeaderKind(Kind):
    """A leader election on a DSN (its dedicated connection), elected in the parent."""

    name = "leader_dsn"

    def hold(self) -> None:
        self.lost: list[int | None] = []
        self.election = pglock.leader(
            self.dsn, self.lock_name, check_interval=1.0, takeover_delay=0,
            on_lost=lambda: self.lost.append(self.election.term),
        )
        self.closers.append(self.election.resign)
        self.entered = self.election
        self.election.__enter__()
        assert self.election.wait_elected(timeout=30)
        self.busy = {pid for pid, _ in advisory_truth_dsn(self.dsn, self.lock_name)}

    def truth(self, obs: psycopg.Connection[Any]) -> Any:
        return advisory_truth(obs, self.lock_name)

    def release(self) -> None:
        assert self.lost == [], f"the parent's leadership was lost: {self.lost}"
        self.election.resign()

    def held_here(self) -> bool:
        return self.election.is_leader

    def child_release(self) -> None:
        forked_error(self.election.resign)

    def child_guard(self) -> None:
        with psycopg.connect(self.dsn) as own, own.transaction():
            forked_error(lambda: self.election.guard(own))

    def child_wait_elected(self) -> None:
        forked_error(lambda: self.election.wait_elected(timeout=0))

    def child_reacquire(self) -> None:
        not_granted(self.election.start)

    def child_use(self) -> None:
        mine = pglock.leader(self.dsn, self.other, check_interval=1.0, takeover_delay=0)
        with mine:
            assert mine.wait_elected(timeout=30)
        rival = pglock.leader(self.dsn, self.lock_name, check_interval=1.0, takeover_delay=0)
        with rival:
            # The parent holds the lock: no wait, however long, elects the child.
            assert not rival.wait_elected(timeout=0.2)


def advisory_truth_dsn(dsn: str, name: str) -> list[tuple[int, str]]:
    with observer(dsn) as obs:
        return advisory_truth(obs, name)


KINDS: list[type[Kind]] = [
    PgLockKind, RWReadKind, PoolLockKind, LockerLockKind, RWWriteKind, SingletonKind,
    LeaseDsnKind, LeaseLockerKind, LeaseHolderDsnKind, LeaseHolderLockerKind, LeaseResumedKind,
    SemaphoreKind, PermitKind, LeaderKind,
]


def actions(kind: type[Kind]) -> list[str]:
    return sorted(a.removeprefix("child_") for a in dir(kind) if a.startswith("child_"))


#: What a thread may hold: locks, and the locks under conditions and events.
SYNC = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Event)


def pglock_locks(roots: Iterable[object]) -> list[Any]:
    """Every lock reachable from ``roots`` and from pglock's modules through objects of
    pglock's (their attributes and slots) and the containers they hold (a condition or an
    event: its lock). Other libraries' objects (connections, threads) are not entered."""
    found: dict[int, Any] = {}
    seen = {id(sys.modules.get("pglock._tracked"))}  # pglock's registry: the walk finds its own
    todo = [*roots, *(m for n, m in list(sys.modules.items()) if n.partition(".")[0] == "pglock")]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, threading.Event):
            obj = obj._cond
        if isinstance(obj, threading.Condition):
            obj = obj._lock
        if isinstance(obj, SYNC):
            found[id(obj)] = obj
        elif isinstance(obj, weakref.ref):
            todo.append(obj())
        elif isinstance(obj, (dict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque, weakref.WeakSet)):
            todo.extend(obj)
        elif _of_pglock(obj if isinstance(obj, types.ModuleType) else type(obj)):
            todo.extend(getattr(obj, "__dict__", {}).values())
            todo.extend(getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ()))
    return list(found.values())


def _of_pglock(obj: type | types.ModuleType) -> bool:
    """A module of pglock's, or a class of one."""
    name = getattr(obj, "__name__" if isinstance(obj, types.ModuleType) else "__module__", None)
    return isinstance(name, str) and name.partition(".")[0] == "pglock"


def free(lock: Any) -> bool:
    """Not held by any thread (this one may take it without waiting)."""
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


@contextlib.contextmanager
def frozen(locks: list[Any]) -> Iterator[None]:
    """A thread of this process holds every lock of ``locks`` (taken all at once, or none and
    again: no deadlock with pglock's threads) for the block, as a thread blocked inside pglock
    holds some at a fork."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        deadline = time.monotonic() + 30
        while not held.is_set() and time.monotonic() < deadline:
            taken = []
            for lock in locks:
                if not lock.acquire(blocking=False):
                    break
                taken.append(lock)
            else:
                held.set()
                done.wait(120)
            for lock in reversed(taken):
                lock.release()
            time.sleep(0.001)

    thread = threading.Thread(target=hold, name="frozen", daemon=True)
    thread.start()
    try:
        assert held.wait(35), "the locks of pglock's could not all be taken"
        yield
    finally:
        done.set()
        thread.join(30)


def sessions(obs: psycopg.Connection[Any], app_name: str) -> dict[int, Any]:
    """The sessions of ``app_name`` but the observer's: pid -> (backend_start, state_change,
    state). A session nobody used since keeps all three."""
    rows = obs.execute(
        "SELECT pid, backend_start, state_change, state FROM pg_stat_activity "
        "WHERE application_name = %s AND pid <> pg_backend_pid()",
        (app_name,),
    ).fetchall()
    return {pid: rest for pid, *rest in rows}


def untouched(before: dict[int, Any], after: dict[int, Any], busy: set[int]) -> list[str]:
    """What happened to the parent's sessions (``before``) meanwhile: ended, or used (a session
    in ``busy`` runs statements of the parent's on its own: only its presence counts)."""
    found = []
    for pid, was in before.items():
        now = after.get(pid)
        if now is None:
            found.append(f"session {pid} ended")
        elif pid not in busy and now != was:
            found.append(f"session {pid} was used: {was} -> {now}")
    return found


class CancelSpy:
    """In a child: a cancel request for one of the parent's sessions (``cancel()`` or
    ``cancel_safe()`` of a connection whose backend pid is one of them) is recorded in ``sent``
    and not sent. Any other cancel goes through."""

    def __init__(self, parent_pids: set[int]) -> None:
        self.sent: list[int] = []
        for method in ("cancel", "cancel_safe"):
            real = getattr(psycopg.Connection, method)

            def spy(conn: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
                if conn.info.backend_pid in parent_pids:
                    self.sent.append(conn.info.backend_pid)
                    return None
                return _real(conn, *args, **kwargs)

            setattr(psycopg.Connection, method, spy)


def watched(fn: ChildFn, parent_pids: set[int]) -> ChildFn:
    """``fn`` in the child, then what the child must not have done: cancel what the parent's
    sessions run (see :class:`CancelSpy`), keep the parent's grants in its keepalive (to renew
    them, or report their loss), or schedule a user callback (``on_lost``)."""

    def run() -> None:
        spy = CancelSpy(parent_pids)
        fn()
        assert not spy.sent, f"the child cancelled statements of the parent's {spy.sent}"
        inherited = [h for h in _keepalive.scheduler.held if h._inherited()]
        assert not inherited, f"the child's keepalive has the parent's grants: {inherited}"
        assert _keepalive.callbacks.thread is None, "the child ran a callback"

    return run


def in_child(forker: str, fn: ChildFn, timeout: float = 60.0) -> int:
    """Run ``fn`` in a forked child (``os.fork`` or ``multiprocessing`` with the fork start
    method) that ends with ``os._exit`` (never the parent's pytest teardown): its exit status,
    0 when ``fn`` returned."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
        if forker == "multiprocessing":
            proc = multiprocessing.get_context("fork").Process(target=_child, args=(fn,))
            proc.start()
            proc.join(timeout)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
                raise AssertionError(f"the child did not end within {timeout} s")
            return proc.exitcode
        pid = os.fork()
    if pid == 0:
        _child(fn)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError(f"the child did not end within {timeout} s")
        time.sleep(0.01)


def _child(fn: ChildFn) -> None:
    code = 1
    try:
        fn()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@contextlib.contextmanager
def observer(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True, application_name="pglock-checker") as obs:
        yield obs


def unique_name() -> str:
    return f"fork:{uuid.uuid4()}"
