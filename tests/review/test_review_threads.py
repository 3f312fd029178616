"""Attack axis (b) and (f): threads sharing one connection; handles dropped while held."""

from __future__ import annotations

import gc
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from _review import held_keys, in_thread

import pglock

pytestmark = pytest.mark.timeout(60)


def _name() -> str:
    return f"review:{uuid.uuid4()}"


def test_a_thread_waiting_for_a_collected_handle_is_woken(installed: str, connect: Any) -> None:
    """docs/locks.md, Garbage collection: a PgLock collected while held "leaves no record that
    lies ... other threads of the connection no longer wait for it".

    Thread A takes ``name`` on a shared connection; thread B asks for it (timeout=None) and waits
    in the process; A's handle is then dropped and collected. B is never woken: the collected
    hold is processed only at the *start* of a later reserve(), and nothing notifies B. With
    timeout=None B waits for ever (here: still blocked after 3 s, while nothing holds the name
    but the dead record); with a timeout it returns False at its end."""
    c = connect()
    name = _name()

    def take_and_drop() -> None:
        h = pglock.pg_lock(c, name)
        assert h.acquire()
        time.sleep(0.3)  # B starts waiting meanwhile; then h is dropped unreleased

    a = threading.Thread(target=take_and_drop)
    a.start()
    time.sleep(0.1)
    waiter = pglock.pg_lock(c, name)
    t, out = in_thread(waiter.acquire)  # timeout=None
    a.join()
    gc.collect()
    t.join(3)
    blocked = t.is_alive()
    # Clean-up: any later lock call on the connection processes the collected hold and wakes B.
    with pglock.pg_lock(c, _name()):
        pass
    t.join(5)
    if out.get("result"):
        waiter.release()
    assert not blocked, "the waiter was still blocked 3 s after the only holder was collected"


def test_a_timed_waiter_behind_a_collected_handle_gets_the_free_name(
    installed: str, connect: Any
) -> None:
    """Companion: the same with acquire(timeout=2): the waiter gets the name its collected
    holder left (before the fix it returned False after 2 s, for a free name)."""
    c = connect()
    name = _name()

    def take_and_drop() -> None:
        h = pglock.pg_lock(c, name)
        assert h.acquire()
        time.sleep(0.3)

    a = threading.Thread(target=take_and_drop)
    a.start()
    time.sleep(0.1)
    waiter = pglock.pg_lock(c, name)
    t, out = in_thread(lambda: waiter.acquire(timeout=2))
    a.join()
    gc.collect()
    t.join(5)
    assert out.get("result") is True
    assert held_keys(installed, [pglock.key(name)]) == [(c.info.backend_pid, "ExclusiveLock", True)]
    waiter.release()
    assert held_keys(installed, [pglock.key(name)]) == []


def _pipeline_race(c: psycopg.Connection[Any], action: Any) -> tuple[bool, dict[str, Any]]:
    """Thread S runs a statement (holding psycopg's connection lock); ``action`` starts and
    queues behind it; thread P then asks to enter pipeline mode and queues too. When S ends,
    ``action`` reads the status (ACTIVE: it waits for the lock), passes pglock's pipeline check
    and lets go of the lock; P may enter pipeline mode before ``action`` takes the lock again
    to send. True if ``action`` is still blocked 3 s later."""
    def busy() -> None:
        try:
            c.execute("SELECT pg_sleep(0.4)")
        except psycopg.Error:
            pass

    def pipeline_user() -> None:
        try:
            with c.pipeline():
                time.sleep(1.0)
                c.execute("SELECT 1")
        except psycopg.Error:
            pass  # the test closes the connection to end a hang

    threading.Thread(target=busy, daemon=True).start()
    time.sleep(0.1)
    t, out = in_thread(action)
    time.sleep(0.1)
    threading.Thread(target=pipeline_user, daemon=True).start()
    t.join(3.5)
    return t.is_alive(), out


def test_a_lock_statement_never_goes_into_another_threads_pipeline(
    installed: str, connect: Any, pg_dsn: str
) -> None:
    """docs/threat-model.md (b): a connection in pipeline mode is refused before any SQL; the
    connection may be "shared with another thread". pglock checks pipeline mode before it takes
    psycopg's connection lock, and not again under it. A thread that enters pipeline mode in
    between gets pglock's prepared lock statement sent into its pipeline with no sync: the
    answer never comes, pglock holds the connection lock for ever, and the pipeline thread
    blocks behind it (both threads hang; here: still blocked after 3 s). Racy by nature (which
    thread gets the lock first), so it is tried up to 10 times."""
    hung = tries = 0
    for _ in range(10):
        c = connect()
        name = _name()
        with pglock.pg_lock(c, name):  # probe and registry done: the next lock is one statement
            pass
        lock = pglock.pg_lock(c, name)
        blocked, _out = _pipeline_race(c, lock.acquire)
        c.close()  # frees both threads
        tries += 1
        if blocked:
            hung += 1
            break
    assert hung == 0, f"pg_lock(...).acquire() hung in another thread's pipeline (try {tries})"


def test_a_release_never_goes_into_another_threads_pipeline(
    installed: str, connect: Any
) -> None:
    """The same race at release(): docs/how-it-works.md says a release in pipeline mode "is
    refused too, and the lock stays held". Here release() hangs instead (its unlock statement is
    in the other thread's pipeline, unanswered), holding psycopg's connection lock."""
    hung = tries = 0
    for _ in range(10):
        c = connect()
        lock = pglock.pg_lock(c, _name())
        assert lock.acquire()
        with pglock.pg_lock(c, _name()):  # the unlock statement is prepared already
            pass
        blocked, _out = _pipeline_race(c, lock.release)
        c.close()
        tries += 1
        if blocked:
            hung += 1
            break
    assert hung == 0, f"release() hung in another thread's pipeline (try {tries})"
