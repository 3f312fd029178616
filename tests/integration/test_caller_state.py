"""Axis (b) of the threat model: the state of the caller's connection when pglock uses it.

Every public API that works on a caller's connection (the ``OPS`` table) runs in every state
of that connection (the ``STATES`` table): autocommit, idle outside a transaction, inside the
caller's transaction (with an uncommitted write of the caller's), in a failed transaction, in
pipeline mode; then on a non-autocommit connection shared with another thread that begins a
transaction (an uncommitted INSERT) at each point where pglock lets go of the connection's
lock (``test_shared_connection``, generated over those points); and with autocommit toggled
between the calls of one hold.

Each case asserts: the answer is the database's (pg_locks, the lease table); pglock never
commits nor rolls back work it did not begin (the other thread's and the caller's uncommitted
rows are neither visible to an observer nor gone from their transaction); the connection is
left in the transaction status it was in; and where pglock refuses (pipeline mode, a failed
transaction, a transaction lock without a transaction), the refusal comes before any SQL, with
nothing held.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from _pgdb import with_params
from psycopg.pq import TransactionStatus
from test_lease_support import lease_database

import pglock
from pglock import _lease
from pglock.cli import status_snapshot

IDLE, INTRANS, INERROR = (
    TransactionStatus.IDLE, TransactionStatus.INTRANS, TransactionStatus.INERROR
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def db(pg_dsn: str) -> Iterator[str]:
    with lease_database(pg_dsn) as dsn:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CREATE TABLE written (id text PRIMARY KEY)")
        yield dsn


class World:
    """An observer, a rival session, a lease held elsewhere, and the test's connections."""

    def __init__(self, db: str, app_name: str, name: str, *, shutdown: bool = True) -> None:
        self.dsn = with_params(db, application_name=app_name)
        self.app_name = app_name
        self.name = name
        self.shutdown = shutdown
        self.stack = contextlib.ExitStack()
        self.obs = self.connect(autocommit=True)
        # TTLs of 25.5 s: a number rounded to one digit (extra_float_digits = -15) reads 30.
        self.lease = pglock.lease(self.dsn, name + ":lease", ttl=25.5)
        self.lease.acquire()
        self.stack.callback(self.lease.release)
        self.semaphore = pglock.semaphore(self.dsn, name + ":sem", 2, ttl=25.5)
        self.permit = self.stack.enter_context(self.semaphore.hold())

    def connect(self, **kw: Any) -> psycopg.Connection[Any]:
        return self.connect_to(self.dsn, **kw)

    def connect_to(self, dsn: str, **kw: Any) -> psycopg.Connection[Any]:
        c = psycopg.connect(dsn, **kw)
        self.stack.callback(c.close)
        return c

    def held(self, pid: int, name: str) -> list[str]:
        rows = self.obs.execute(
            "SELECT mode FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = %s"
            " AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = %s",
            (pid, pglock.key(name)),
        ).fetchall()
        return [m for (m,) in rows]

    def visible(self, ids: list[str]) -> list[str]:
        rows = self.obs.execute("SELECT id FROM written WHERE id = ANY(%s)", (ids,)).fetchall()
        return sorted(i for (i,) in rows)

    def expiry(self, table: str, where: str, name: str, holder: str) -> tuple[Any, float]:
        """(expires_at, seconds left) of a lease or permit, as the observer reads them."""
        row = self.obs.execute(
            f"SELECT expires_at, extract(epoch FROM expires_at - clock_timestamp())::float8"
            f" FROM pglock.{table} WHERE {where} = %s AND holder = %s", (name, holder)
        ).fetchone()
        assert row is not None
        return row[0], row[1]

    def activity(self, pid: int) -> tuple[Any, ...]:
        row = self.obs.execute(
            "SELECT query, state_change, xact_start FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        assert row is not None
        return tuple(row)

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            if self.shutdown:
                _lease.shutdown()


@pytest.fixture
def world(db: str, app_name: str, name: str) -> Iterator[World]:
    w = World(db, app_name, name)
    try:
        yield w
    finally:
        w.close()


# --- the operations: each is one public call (or one hold) on the caller's connection ----------

Op = Callable[[World, psycopg.Connection[Any]], None]


def _hold(timeout: float | None, many: bool, shared: bool = False) -> Op:
    def op(w: World, c: psycopg.Connection[Any]) -> None:
        names = [w.name + ":a", w.name + ":b"] if many else [w.name + ":a"]
        lock = pglock.pg_lock(c, names, timeout=timeout, shared=shared)
        assert lock.acquire() is True
        pid = c.info.backend_pid
        mode = "ShareLock" if shared else "ExclusiveLock"
        assert all(w.held(pid, n) == [mode] for n in names)
        lock.release()
        assert all(w.held(pid, n) == [] for n in names)

    return op


def _busy(timeout: float) -> Op:
    """A name another session holds: not acquired, nothing held, the transaction as it was."""

    def op(w: World, c: psycopg.Connection[Any]) -> None:
        rival = w.connect(autocommit=True)
        rival.execute("SELECT pg_advisory_lock(%s)", (pglock.key(w.name + ":busy"),))
        assert pglock.pg_lock(c, w.name + ":busy", timeout=timeout).acquire() is False
        assert w.held(c.info.backend_pid, w.name + ":busy") == []
        rival.execute("SELECT pg_advisory_unlock_all()")

    return op


def _xact(timeout: float | None) -> Op:
    def op(w: World, c: psycopg.Connection[Any]) -> None:
        pglock.xact_lock(c, w.name + ":x", timeout=timeout)
        assert w.held(c.info.backend_pid, w.name + ":x") == ["ExclusiveLock"]

    return op


def _try_xact(w: World, c: psycopg.Connection[Any]) -> None:
    assert pglock.try_xact_lock(c, [w.name + ":x", w.name + ":y"]) is True
    assert w.held(c.info.backend_pid, w.name + ":y") == ["ExclusiveLock"]


def _guard(w: World, c: psycopg.Connection[Any]) -> None:
    w.lease.guard(c)  # a lease held: no LockLost


def _lease_info(w: World, c: psycopg.Connection[Any]) -> None:
    info = pglock.lease_info(c, w.name + ":lease")
    assert info is not None and (info.holder, info.token) == (w.lease.holder, w.lease.token)
    expires_at, left = w.expiry("lease", "name", info.name, info.holder)
    assert info.expires_at == expires_at
    assert abs(info.expires_in - left) < 1.0  # read a moment apart; not rounded


def _list_leases(w: World, c: psycopg.Connection[Any]) -> None:
    found = pglock.list_leases(c, prefix=w.name)
    assert [(x.name, x.token) for x in found] == [(w.name + ":lease", w.lease.token)]


def _advisory_locks(w: World, c: psycopg.Connection[Any]) -> None:
    rival = w.connect(autocommit=True)
    rival.execute("SELECT pg_advisory_lock(%s)", (pglock.key(w.name + ":seen"),))
    found = pglock.advisory_locks(c, w.name + ":seen")
    assert [(x.pid, x.granted) for x in found] == [(rival.info.backend_pid, True)]
    rival.execute("SELECT pg_advisory_unlock_all()")


def _semaphores(w: World, c: psycopg.Connection[Any]) -> None:
    found = pglock.semaphores(c, w.name + ":sem")
    assert [(s.limit, s.held) for s in found] == [(2, 1)]
    assert [h.holder for h in found[0].holders] == [w.permit.holder]
    h = found[0].holders[0]
    expires_at, left = w.expiry("semaphore_permit", "semaphore", w.name + ":sem", h.holder)
    assert h.expires_at == expires_at
    assert abs(h.expires_in - left) < 1.0  # read a moment apart; not rounded


def _status(w: World, c: psycopg.Connection[Any]) -> None:
    snap = status_snapshot(c, [w.name + ":lease"], "pglock")
    assert [x["token"] for x in snap["leases"]] == [w.lease.token]


@dataclass(frozen=True)
class Spec:
    op: Op
    needs_transaction: bool = False  # a transaction lock or a guard: refused in autocommit


OPS: dict[str, Spec] = {
    "pg_lock-one-t0": Spec(_hold(0, False)),
    "pg_lock-one-t0.5": Spec(_hold(0.5, False)),
    "pg_lock-one-tNone": Spec(_hold(None, False)),
    "pg_lock-many-t0": Spec(_hold(0, True)),
    "pg_lock-many-t0.5": Spec(_hold(0.5, True)),
    "pg_lock-many-tNone": Spec(_hold(None, True)),
    "pg_lock-shared-t0.5": Spec(_hold(0.5, False, shared=True)),
    "pg_lock-busy-t0": Spec(_busy(0)),
    "pg_lock-busy-t0.05": Spec(_busy(0.05)),
    "xact_lock-t0.5": Spec(_xact(0.5), needs_transaction=True),
    "xact_lock-tNone": Spec(_xact(None), needs_transaction=True),
    "try_xact_lock": Spec(_try_xact, needs_transaction=True),
    "guard": Spec(_guard, needs_transaction=True),
    "lease_info": Spec(_lease_info),
    "list_leases": Spec(_list_leases),
    "advisory_locks": Spec(_advisory_locks),
    "semaphores": Spec(_semaphores),
    "status": Spec(_status),
}


def test_the_table_covers_every_api_on_a_callers_connection() -> None:
    """A public API that takes the caller's connection gets a row here."""
    on_a_connection = {
        "pg_lock", "xact_lock", "try_xact_lock", "lease_info", "list_leases", "advisory_locks",
        "semaphores",
    }
    covered = {op.split("-")[0] for op in OPS} | {"guard", "status"}
    assert on_a_connection <= covered


# --- the states ----------------------------------------------------------------------------


def _write(c: psycopg.Connection[Any]) -> str:
    """An uncommitted write of the caller's (or another thread's): its id."""
    i = uuid.uuid4().hex
    c.execute("INSERT INTO written (id) VALUES (%s)", (i,))
    return i


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "non-autocommit"])
def test_idle(world: World, op: str, autocommit: bool) -> None:
    """Outside any transaction: answered, and the connection is left idle."""
    c = world.connect(autocommit=autocommit)
    spec = OPS[op]
    if spec.needs_transaction and autocommit:
        before = world.activity(c.info.backend_pid)
        with pytest.raises(pglock.InvalidConnectionState):
            spec.op(world, c)
        assert world.activity(c.info.backend_pid) == before  # refused before any SQL
        return
    spec.op(world, c)
    if spec.needs_transaction:  # it begins the caller's transaction, which is the caller's
        assert c.info.transaction_status == INTRANS
        c.rollback()
    assert c.info.transaction_status == IDLE


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("block", [False, True], ids=["begun", "transaction-block"])
def test_in_the_callers_transaction(world: World, op: str, block: bool) -> None:
    """Inside the caller's transaction (with an uncommitted write of its own): answered, and
    the transaction is neither committed nor rolled back nor failed by pglock."""
    c = world.connect(autocommit=block)
    with c.transaction(force_rollback=True) if block else contextlib.nullcontext():
        mine = _write(c)
        OPS[op].op(world, c)
        assert c.info.transaction_status == INTRANS
        assert c.execute("SELECT count(*) FROM written WHERE id = %s", (mine,)).fetchone() == (1,)
        assert world.visible([mine]) == []
        if not block:
            c.rollback()
    assert world.visible([mine]) == []


@pytest.mark.parametrize("op", OPS)
def test_in_a_failed_transaction(world: World, op: str) -> None:
    """A failed transaction accepts no statement: refused before any SQL, still failed."""
    c = world.connect()
    with pytest.raises(psycopg.errors.DivisionByZero):
        c.execute("SELECT 1 / 0")
    before = world.activity(c.info.backend_pid)
    with pytest.raises(pglock.InvalidConnectionState):
        OPS[op].op(world, c)
    assert c.info.transaction_status == INERROR
    assert world.activity(c.info.backend_pid) == before
    c.rollback()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "non-autocommit"])
def test_in_pipeline_mode(world: World, op: str, autocommit: bool) -> None:
    """Pipeline mode: the answer to a statement arrives only at the pipeline's sync, after
    pglock would report it. Refused before any SQL; the pipeline goes on unharmed."""
    c = world.connect(autocommit=autocommit)
    pid = c.info.backend_pid
    before = world.activity(pid)
    with c.pipeline():
        with pytest.raises(pglock.InvalidConnectionState, match="pipeline"):
            OPS[op].op(world, c)
        assert world.activity(pid) == before
        cur = c.execute("SELECT 42")
    assert cur.fetchone() == (42,)
    assert world.obs.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (pid,)
    ).fetchone() == (0,)
    assert not c.closed


def test_a_release_in_pipeline_mode_is_refused_and_the_lock_stays_held(world: World) -> None:
    c = world.connect(autocommit=True)
    lock = pglock.pg_lock(c, world.name)
    assert lock.acquire()
    with c.pipeline():
        with pytest.raises(pglock.InvalidConnectionState, match="pipeline"):
            lock.release()
        assert lock.locked  # nothing changed: still held, by this handle
    assert world.held(c.info.backend_pid, world.name) == ["ExclusiveLock"]
    lock.release()
    assert world.held(c.info.backend_pid, world.name) == []


# --- a non-autocommit connection shared with another thread ------------------------------------


class Interleaver:
    """Stands in for the connection's lock: at the ``at``-th time pglock lets go of it, another
    thread writes on the connection (beginning a transaction of its own on an idle one) before
    pglock can take the lock again. ``at`` 0 only counts."""

    def __init__(self, conn: psycopg.Connection[Any], at: int) -> None:
        self.conn = conn
        self.real = conn.lock
        self.at = at
        self.released = 0
        self.written: list[str] = []
        self.errors: list[BaseException] = []
        self._other = threading.local()

    def __enter__(self) -> bool:
        return self.real.__enter__()

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        return self.real.acquire(*args, **kwargs)

    def locked(self) -> bool:
        return self.real.locked()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def release(self) -> None:
        self.real.release()
        if getattr(self._other, "active", False):
            return
        self.released += 1
        if self.released == self.at:
            t = threading.Thread(target=self._write)
            t.start()
            t.join(30)

    def _write(self) -> None:
        self._other.active = True
        try:
            self.written.append(_write(self.conn))
        except BaseException as exc:  # e.g. it found pglock's transaction failed
            self.errors.append(exc)


def _releases(world: World, op: str) -> int:
    """How many times ``op`` lets go of the connection's lock, on a fresh connection."""
    c = world.connect()
    spy = Interleaver(c, at=0)
    c.lock = spy  # type: ignore[misc]
    try:
        OPS[op].op(world, c)
    finally:
        c.lock = spy.real  # type: ignore[misc]
        c.rollback()
    return spy.released


SHARED = [op for op, spec in OPS.items() if not spec.needs_transaction]


@pytest.mark.parametrize("op", SHARED)
def test_shared_connection(world: World, op: str) -> None:
    """At every point where pglock lets go of the connection's lock, another thread begins a
    transaction with an uncommitted INSERT. pglock's answer stays true, and it never commits
    nor rolls back that thread's transaction (before the fix, pglock's own commit after a
    timed lock, a read or a failed attempt committed it)."""
    points = _releases(world, op)
    assert points >= 1
    for at in range(1, points + 1):
        c = world.connect()
        spy = Interleaver(c, at)
        c.lock = spy  # type: ignore[misc]
        try:
            OPS[op].op(world, c)
        finally:
            c.lock = spy.real  # type: ignore[misc]
        assert spy.errors == [], f"the other thread failed at point {at}: {spy.errors}"
        assert len(spy.written) == 1
        assert world.visible(spy.written) == [], f"pglock committed it (point {at})"
        assert c.info.transaction_status == INTRANS, f"pglock ended it (point {at})"
        assert c.execute(
            "SELECT count(*) FROM written WHERE id = ANY(%s)", (spy.written,)
        ).fetchone() == (1,), f"pglock rolled it back (point {at})"
        c.rollback()
        assert world.visible(spy.written) == []


# --- autocommit toggled between the calls of one hold ------------------------------------------


@pytest.mark.parametrize("first", [True, False], ids=["then-off", "then-on"])
@pytest.mark.parametrize("timeout", [None, 0, 0.5], ids=["tNone", "t0", "t0.5"])
def test_autocommit_toggled_between_acquire_and_release(
    world: World, first: bool, timeout: float | None
) -> None:
    c = world.connect(autocommit=first)
    lock = pglock.pg_lock(c, world.name, timeout=timeout)
    assert lock.acquire()
    assert c.info.transaction_status == IDLE
    c.autocommit = not first
    assert world.held(c.info.backend_pid, world.name) == ["ExclusiveLock"]
    lock.release()
    assert world.held(c.info.backend_pid, world.name) == []
    assert c.info.transaction_status == IDLE
    c.autocommit = first
    assert lock.acquire()  # and again, toggled back
    lock.release()
    assert c.info.transaction_status == IDLE
