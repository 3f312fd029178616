"""Attack axis (f): a forked child and the parent's connection."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest
from _review import held_keys

import pglock

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
]


def _in_child(fn: Any) -> str:
    """Run ``fn()`` in a forked child; its repr, or the name of the exception it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            out = repr(fn())
        except BaseException as exc:
            out = type(exc).__name__
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return json.loads(f.read())


def test_reset_connection_in_a_forked_child_releases_nothing_of_the_parent(
    installed: str, connect: Any
) -> None:
    """docs/threat-model.md (f): "A forked child never releases ... what its parent holds
    (session and pool locks ...), nor the parent's connections ... a connection pglock used in
    the parent is refused (InvalidConnectionState)". pg_lock, xact_lock and lease_info on such a
    connection are refused in the child; pglock.reset_connection(conn) is not: it runs
    pg_advisory_unlock_all() on the parent's session. The parent's handle still says locked;
    its lock is gone from pg_locks and another session acquires it while the parent's live session
carries on under its handle (two holders; the parent's writes are not fenced: its session is
alive); the parent learns it only at release (LockLost)."""
    c = connect()
    name = f"review:{uuid.uuid4()}"
    lock = pglock.pg_lock(c, name)
    assert lock.acquire()
    child = _in_child(lambda: pglock.reset_connection(c))
    held = held_keys(installed, [pglock.key(name)])
    still_locked = lock.locked
    other = pglock.pg_lock(connect(), name, timeout=0)
    second = other.acquire()  # while the parent's handle (and session) carry on
    if second:
        other.release()
    try:
        lock.release()
    except pglock.LockLost:
        pass
    assert child == "InvalidConnectionState" or held, (
        f"child: {child}; parent handle locked={still_locked}; pg_locks: {held}; "
        f"another session acquired it meanwhile: {second}"
    )


def test_advisory_locks_in_a_forked_child_refuses_the_parents_connection(
    installed: str, connect: Any
) -> None:
    """The same promise for the introspection call: advisory_locks(conn) in the child sends its
    statements on the parent's session (had the parent been using it at that moment, the two
    processes would have interleaved on one socket)."""
    c = connect()
    with pglock.pg_lock(c, f"review:{uuid.uuid4()}"):
        child = _in_child(lambda: len(pglock.advisory_locks(c)))
    assert child == "InvalidConnectionState", f"the child got an answer: {child}"
