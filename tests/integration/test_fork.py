"""Process lifecycle: fork and exit (docs/locks.md, "Processes and fork"; GC: test_gc.py).

A forked child never releases, renews or uses what its parent holds, nor the parent's
connections. The cases are generated: every holding kind of _forking.KINDS x every action its
inherited copy offers a child (``child_<action>``), in a child made by ``os.fork`` and by
``multiprocessing`` with the fork start method; then a child that exits normally (``sys.exit``
inside the ``with`` block, or the end of its script: atexit and garbage collection run), in a
script of its own. After the child, Postgres must show the parent's hold unchanged and every
session of the parent untouched (present, not used), and the parent's own release must work and
report no loss.

A parent thread may be inside pglock at the fork, holding locks of its objects and modules (a
blocked ``acquire()``, a renewal, a leader's check, telemetry's shutdown): the ``frozen`` cases
fork while a thread of the parent holds every lock of pglock's reachable from the kind's objects
and pglock's modules; the child must not wait on any.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _inputs
import psycopg
import pytest
import sqlalchemy as sa
from _forking import (
    KINDS,
    Kind,
    actions,
    advisory_truth_dsn,
    forked_error,
    free,
    frozen,
    in_child,
    observer,
    pglock_locks,
    sessions,
    unique_name,
    untouched,
    watched,
)
from _pgdb import sa_url

import pglock
import pglock.sqlalchemy
from pglock import _keepalive

HERE = Path(__file__).parent
CELLS = [(kind, action) for kind in KINDS for action in actions(kind)]
#: (forker, frozen): a frozen child is forked while a parent thread holds pglock's locks.
FORKS = [("os.fork", False), ("multiprocessing", False), ("os.fork", True)]


@pytest.mark.parametrize(("forker", "frozen_"), FORKS, ids=["os.fork", "mp", "frozen"])
@pytest.mark.parametrize(
    ("kind", "action"), CELLS, ids=[f"{k.name}-{a}" for k, a in CELLS]
)
def test_child_leaves_the_parents_holds_alone(
    kind: type[Kind], action: str, forker: str, frozen_: bool, dsn: str, app_name: str
) -> None:
    k = kind(dsn, unique_name())
    try:
        k.hold()
        with observer(dsn) as obs:
            truth, before = k.truth(obs), sessions(obs, app_name)
            assert truth, "the parent does not hold it"
            child = watched(getattr(k, f"child_{action}"), set(before))
            with frozen(pglock_locks([vars(k)]) if frozen_ else []):
                status = in_child(forker, child, timeout=20 if frozen_ else 60)
            assert status == 0, f"the child's {action} failed (its traceback: captured stderr)"
            assert k.truth(obs) == truth
            assert untouched(before, sessions(obs, app_name), k.busy) == []
            k.release()
            assert k.released(obs)
    finally:
        k.close()


@pytest.mark.parametrize("how", ["sys_exit", "script_end"])
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_child_that_exits_normally_sends_nothing(
    kind: type[Kind], how: str, dsn: str, app_name: str
) -> None:
    root = Path(pglock.__file__).parent.parent
    path = os.pathsep.join([str(root), str(HERE), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(HERE / "_fork_exit.py"), kind.name, how, dsn, app_name,
         unique_name()],
        capture_output=True, text=True, timeout=100, env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {
        "child": 0, "truth_kept": True, "sessions": [], "release": None, "released": True,
    }, done.stderr


@pytest.mark.parametrize("forker", ["os.fork", "multiprocessing"])
def test_child_never_reports_the_parents_lease_lost(dsn: str, forker: str) -> None:
    """Past the deadline its copy of the parent's lease had (the parent renews on), the child
    neither reads it lost nor reports it: check() and extend() raise the fork's RuntimeError,
    and on_lost never runs in the child."""
    lost: list[int] = []
    lease = pglock.lease(dsn, unique_name(), ttl=2.0, on_lost=lambda _: lost.append(os.getpid()))
    assert lease.acquire()
    try:
        inherited_deadline = lease._deadline

        def child() -> None:
            while time.monotonic() < inherited_deadline:
                time.sleep(0.02)
            assert not lease.locked and not lease.lost
            forked_error(lease.check)
            forked_error(lease.extend)
            assert _keepalive.callbacks.thread is None and lost == []

        assert in_child(forker, child) == 0
        assert lease.locked
    finally:
        lease.release()
    assert lost == []


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_child_finds_every_pglock_lock_free(kind: type[Kind], dsn: str) -> None:
    """Forked while a parent thread holds every lock of pglock's (of the kind's objects and of
    pglock's modules), the child finds each of them free: nothing it does can wait on them."""
    k = kind(dsn, unique_name())
    try:
        k.hold()
        locks = pglock_locks([vars(k)])
        assert locks, "no lock found: the walk proves nothing"

        def child() -> None:
            held = [lock for lock in pglock_locks([vars(k)]) if not free(lock)]
            assert not held, f"held in the child: {held}"

        with frozen(locks):
            assert not any(free(lock) for lock in locks)  # held by the thread, as it should
            assert in_child("os.fork", child, timeout=20) == 0
        k.release()
    finally:
        k.close()


def test_child_configures_telemetry_while_a_parent_thread_holds_every_lock() -> None:
    """A parent thread inside ``configure_telemetry`` at the fork (it waits there up to 5 s for
    a stuck exporter) leaves the child's own calls free to run."""

    def child() -> None:
        pglock.configure_telemetry(enabled=False)

    with frozen(pglock_locks([])):
        assert in_child("os.fork", child, timeout=20) == 0


def test_child_of_a_parent_thread_blocked_in_a_lease_acquire(dsn: str) -> None:
    """A thread of the parent blocked in ``acquire()`` (queued in the database) at the fork: the
    child's copy of that handle neither hangs nor gets the lease."""
    name = unique_name()
    holder = pglock.lease(dsn, name, ttl=60)
    assert holder.acquire(timeout=0)
    waiter = pglock.lease(dsn, name, ttl=60)
    thread = threading.Thread(target=lambda: waiter.acquire(timeout=30), daemon=True)
    thread.start()
    try:
        with observer(dsn) as obs:
            for _ in range(1000):  # until it waits in the database's queue
                if obs.execute("SELECT 1 FROM pglock.lease_waiter WHERE name = %s",
                               (name,)).fetchone():
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("the waiter never queued")

        def child() -> None:
            assert waiter.acquire(timeout=0) is False
            try:
                waiter.release()
            except RuntimeError as exc:
                assert "not held" in str(exc), exc
            else:
                raise AssertionError("released a lease the child never held")

        assert in_child("os.fork", child, timeout=20) == 0
    finally:
        holder.release()
        thread.join(30)
        waiter.release()


#: Every public callable with a connection parameter (found from the API: tests/_inputs.py),
#: and the name of that parameter. A new one joins the table by itself.
CONN_PARAMS = ("conn", "source", "target", "pool_or_engine", "connection_or_url", "engine",
               "engine_or_pool")
TAKES_A_CONNECTION = sorted(
    (qualname, next(p for p in params if p in CONN_PARAMS))
    for qualname, (_, params) in _inputs.surface().items()
    if set(params) & set(CONN_PARAMS)
)
#: Methods of a handle the child makes itself (on its own connections) that take one.
_HANDLES: dict[str, Callable[[str, str], Any]] = {
    "Lease": lambda dsn, name: pglock.lease(dsn, name, ttl=30),
    "LeaderElection": lambda dsn, name: pglock.leader(dsn, name),
}


def _call(qualname: str, param: str, conn: Any, dsn: str, name: str) -> None:
    """Call ``qualname`` with ``conn`` as ``param`` and samples of its other required
    parameters, then use what it returns (enter it, or its read side)."""
    owner, _, method = qualname.rpartition(".")
    if owner in _HANDLES:
        handle = _HANDLES[owner](dsn, name)
        if owner == "Lease":
            assert handle.acquire(timeout=5)
        try:
            getattr(handle, method)(conn)
        finally:
            if owner == "Lease":
                handle.release()
        return
    fn, _ = _inputs.surface()[qualname]
    kwargs = {param: conn}
    for p in inspect.signature(fn).parameters.values():
        if p.default is p.empty and p.name not in (param, "self") and p.kind is not p.VAR_KEYWORD:
            kwargs[p.name] = _inputs.PARAMS[p.name].valid[0]
    result = fn(**kwargs)
    if hasattr(result, "read"):
        result = result.read()
    if hasattr(result, "__enter__"):
        with result:
            pass


#: Where a closed connection (the oracle below) does not tell what a call does with one:
#: a leader only copies its connection parameters (it never sends on it), and
#: reset_connection() of a closed connection has nothing to release (it returns).
NOT_BY_THE_ORACLE = {"LeaderElection": "copies", "leader": "copies", "reset_connection": "refuses"}


def _what_it_does(qualname: str, param: str, dsn: str) -> str:
    """"refuses" (a call that takes a caller's connection: a closed one gets
    InvalidConnectionState from it, with no I/O), "TypeError" (it takes none) or "copies"."""
    if qualname in NOT_BY_THE_ORACLE:
        return NOT_BY_THE_ORACLE[qualname]
    closed = psycopg.connect(dsn, autocommit=True)
    closed.close()
    try:
        _call(qualname, param, closed, dsn, unique_name())
    except pglock.InvalidConnectionState:
        return "refuses"
    except TypeError:
        return "TypeError"
    raise AssertionError(f"{qualname} used a closed connection")


@pytest.mark.parametrize("used_by", ["pg_lock", "the call"])
@pytest.mark.parametrize(("qualname", "param"), TAKES_A_CONNECTION,
                         ids=[q for q, _ in TAKES_A_CONNECTION])
def test_every_call_refuses_in_a_child_the_connection_pglock_used_in_the_parent(
    qualname: str, param: str, used_by: str, dsn: str, app_name: str
) -> None:
    """Each public call given, in a forked child, a connection pglock used in the parent (it
    holds a pg_lock there, or the parent made the same call on it, whatever became of that)
    raises InvalidConnectionState naming the fork before sending anything, if it takes a
    caller's connection (else its TypeError; a leader copies the connection's parameters for a
    connection of its own). The parent's session is untouched and its lock stays held."""
    does = _what_it_does(qualname, param, dsn)
    conn = psycopg.connect(dsn, autocommit=True)
    try:
        with contextlib.ExitStack() as stack:
            if used_by == "pg_lock":
                lock = stack.enter_context(pglock.pg_lock(conn, unique_name()))
            else:
                with contextlib.suppress(pglock.LockError, TypeError):
                    _call(qualname, param, conn, dsn, unique_name())
            obs = stack.enter_context(observer(dsn))
            before = sessions(obs, app_name)

            def child() -> None:
                try:
                    _call(qualname, param, conn, dsn, unique_name())
                except pglock.InvalidConnectionState as exc:
                    assert does == "refuses" and "forked" in str(exc), exc
                except TypeError:
                    assert does == "TypeError"
                else:
                    assert does == "copies", f"{qualname} used the parent's connection"

            assert in_child("os.fork", child, timeout=30) == 0
            after = sessions(obs, app_name)
            assert untouched({conn.info.backend_pid: before[conn.info.backend_pid]}, after,
                             set()) == []
            assert used_by != "pg_lock" or lock.locked
    finally:
        conn.close()


@pytest.mark.parametrize("pool", ["sqlalchemy", "reset_connection"])
def test_a_pool_reset_in_a_child_never_ends_the_parents_session(
    pool: str, pg_dsn: str, dsn: str, app_name: str
) -> None:
    """A pool inherited by a child resets, there, a connection pglock used in the parent: the
    reset is refused, and the pool's discard of the connection (SQLAlchemy invalidates it;
    psycopg_pool closes it) sends nothing to the parent's session, whose lock stays held: had
    the close ended that session, Postgres would have dropped a lock the parent believes it
    holds."""
    name = unique_name()
    if pool == "sqlalchemy":
        engine = sa.create_engine(sa_url(pg_dsn), connect_args={"application_name": app_name})
        pglock.sqlalchemy.release_on_checkin(engine)
        sa_conn = engine.connect()
        conn = sa_conn.connection.driver_connection
        give_back: Callable[[], object] = sa_conn.close
    else:
        conn = psycopg.connect(dsn, autocommit=True)

        def give_back() -> None:  # what psycopg_pool does when its reset hook raises
            try:
                pglock.reset_connection(conn)
            finally:
                conn.close()

    try:
        with pglock.pg_lock(conn, name) as lock, observer(dsn) as obs:
            before = sessions(obs, app_name)
            pid = conn.info.backend_pid

            def child() -> None:
                with contextlib.suppress(pglock.InvalidConnectionState):
                    give_back()
                assert conn.closed or conn.broken  # the child's copy is gone

            assert in_child("os.fork", child, timeout=30) == 0
            time.sleep(0.2)  # a Terminate message would have ended the session by now
            assert untouched({pid: before[pid]}, sessions(obs, app_name), set()) == []
            assert advisory_truth_dsn(dsn, name), "the parent's lock was dropped"
            assert lock.locked
    finally:
        if pool == "sqlalchemy":
            sa_conn.close()
            engine.dispose()
        else:
            conn.close()
