"""Process lifecycle: fork and exit (docs/locks.md, "Processes and fork"; GC: test_gc.py).

A forked child never releases, renews or uses what its parent holds, nor the parent's
connections. The cases are generated: every holding kind of _forking.KINDS x every action its
inherited copy offers a child (``child_<action>``), in a child made by ``os.fork`` and by
``multiprocessing`` with the fork start method; then a child that exits normally (``sys.exit``
inside the ``with`` block, or the end of its script: atexit and garbage collection run), in a
script of its own. After the child, Postgres must show the parent's hold unchanged and every
session of the parent untouched (present, not used), and the parent's own release must work and
report no loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _forking import (
    KINDS,
    Kind,
    actions,
    forked_error,
    in_child,
    observer,
    sessions,
    unique_name,
    untouched,
    watched,
)

import pglock
from pglock import _keepalive

HERE = Path(__file__).parent
CELLS = [(kind, action) for kind in KINDS for action in actions(kind)]


@pytest.mark.parametrize("forker", ["os.fork", "multiprocessing"])
@pytest.mark.parametrize(
    ("kind", "action"), CELLS, ids=[f"{k.name}-{a}" for k, a in CELLS]
)
def test_child_leaves_the_parents_holds_alone(
    kind: type[Kind], action: str, forker: str, dsn: str, app_name: str
) -> None:
    k = kind(dsn, unique_name())
    try:
        k.hold()
        with observer(dsn) as obs:
            truth, before = k.truth(obs), sessions(obs, app_name)
            assert truth, "the parent does not hold it"
            status = in_child(forker, watched(getattr(k, f"child_{action}"), set(before)))
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
