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

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _forking import (
    KINDS,
    Kind,
    actions,
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

import pglock
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
