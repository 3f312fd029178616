"""Goal (6): wrong answers in introspection (``advisory_locks``, ``pglock status``)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from _review import backend_waiting, in_thread, wait_until

import pglock
from pglock import cli

pytestmark = pytest.mark.timeout(60)


def _name() -> str:
    return f"review:{uuid.uuid4()}"


def test_held_for_of_a_lock_whose_session_now_waits_for_another(
    installed: str, connect: Any, capsys: Any
) -> None:
    """docs/how-it-works.md: basis "statement" means "the holder's latest statement is the one
    that took this lock", and then held_since is exact; else the bound is the session's start.

    The most common incident shape: session S holds ``a`` (for 1.5 s here) and now waits for
    ``b``. Its current statement is pglock's ``pg_advisory_lock($1)`` (for b, not granted) and
    ``a`` is its only *granted* advisory lock, so the ``$1`` rule credits that statement with
    granting ``a``: advisory_locks() reports held_since_basis "statement" and held_for = how
    long S has waited for b (here ~0.3 s), and `pglock status` prints it without "<=", as
    exact."""
    s, other, obs = connect(), connect(), connect()
    a, b = _name(), _name()
    with pglock.pg_lock(s, b):  # b registered: S's wait for it is the one-statement fast path
        pass
    ha = pglock.pg_lock(s, a)
    assert ha.acquire()
    hb = pglock.pg_lock(other, b)
    assert hb.acquire()
    time.sleep(1.5)
    s.execute("SELECT 1")  # S moves on
    wait_b = pglock.pg_lock(s, b)
    t, out = in_thread(wait_b.acquire)
    try:
        assert wait_until(lambda: backend_waiting(installed, s.info.backend_pid))
        time.sleep(0.3)
        (lock,) = pglock.advisory_locks(obs, a)
        assert cli.main(["status", "--dsn", installed, a]) == 0
        printed = capsys.readouterr().out
    finally:
        hb.release()
        t.join(10)
        if out.get("result"):
            wait_b.release()
        ha.release()
    row = [line for line in printed.splitlines() if a in line]
    assert lock.held_for is not None and (
        lock.held_for >= 1.5 or lock.held_since_basis == "session"
    ), f"held_for={lock.held_for:.2f} basis={lock.held_since_basis}; status row: {row}"


def test_held_for_of_a_session_lock_after_a_transaction_lock_on_the_same_key(
    installed: str, connect: Any
) -> None:
    """The key-in-text rule: a session holding ``a`` for 1.5 s takes the transaction lock on the
    same name (re-entrant in Postgres). The pg_locks row is the same; advisory_locks() now says
    basis "statement", held_for ~0 s."""
    s, obs = connect(autocommit=False), connect()
    a = _name()
    ha = pglock.pg_lock(s, a)
    assert ha.acquire()
    time.sleep(1.5)
    s.execute("SELECT 1")
    s.commit()
    assert pglock.try_xact_lock(s, a)
    (lock,) = pglock.advisory_locks(obs, a)
    s.commit()
    ha.release()
    assert lock.held_for is not None and (
        lock.held_for >= 1.5 or lock.held_since_basis == "session"
    ), f"held_for={lock.held_for:.2f} basis={lock.held_since_basis}"


def test_a_name_in_the_registry_that_does_not_hash_to_its_key_is_not_shown(
    installed: str, connect: Any, capsys: Any
) -> None:
    """The name registry is trusted when its table is pglock's own; docs/reference/sql.md grants
    INSERT on it to application roles ("optional: record and read lock names"). Such a role (or
    any buggy writer) can insert (key("billing:invoice:42"), "cache:warmup") before anyone took
    the real name. pglock never checks that the name hashes to the key (one sha256): every
    holder of billing:invoice:42 is then shown as "cache:warmup", also by
    advisory_locks(conn, "billing:invoice:42"), whose result names another lock than asked."""
    holder, obs = connect(), connect()
    victim = _name()
    obs.execute(
        "INSERT INTO pglock.lock_names (key, name) VALUES (%s, 'cache:warmup')",
        (pglock.key(victim),),
    )
    with pglock.pg_lock(holder, victim):
        (lock,) = pglock.advisory_locks(obs, victim)
        assert cli.main(["status", "--dsn", installed, victim]) == 0
    printed = capsys.readouterr().out
    obs.execute("DELETE FROM pglock.lock_names WHERE key = %s", (pglock.key(victim),))
    assert lock.name in (victim, None), f"shown as {lock.name!r}; status:\n{printed}"


def test_status_never_shows_two_locks_as_one(installed: str, connect: Any, capsys: Any) -> None:
    """`pglock status` leaves the LOCK column empty for a row whose label equals the previous
    row's, meaning "another session of the same lock". Two different keys with one label (a
    second registry row naming a lock someone else holds) then read as two sessions holding one
    exclusive lock."""
    h1, h2, obs = connect(), connect(), connect()
    real, other = _name(), _name()
    obs.execute(
        "INSERT INTO pglock.lock_names (key, name) VALUES (%s, %s)", (pglock.key(other), real)
    )
    with pglock.pg_lock(h1, real), pglock.pg_lock(h2, other):
        assert cli.main(["status", "--dsn", installed, real, other]) == 0
    printed = capsys.readouterr().out
    obs.execute("DELETE FROM pglock.lock_names WHERE key = %s", (pglock.key(other),))
    rows = [line.split("exclusive")[0].strip() for line in printed.splitlines()
            if "exclusive" in line]
    # Two rows, each with its own label: no row left blank as "another session of the above".
    assert len(rows) == 2 and all(rows) and len(set(rows)) == 2, (
        "two exclusive holders shown under one lock:\n" + printed
    )
