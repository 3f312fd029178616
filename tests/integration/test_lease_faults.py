"""Leases and dying holders: SIGKILL, then expiry (not earlier) or resume by holder id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_lease_support import lease_database, row_of, wait_until, with_app

import pglock
from pglock import _lease

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL"),
]

ROOT = Path(__file__).resolve().parents[2]

# Acquires, prints "<holder> <token>", then keeps the lease alive until killed.
HOLDER = textwrap.dedent(
    """
    import sys, time
    import pglock
    dsn, name, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    lease = pglock.lease(dsn, name, ttl=ttl, timeout=30)
    lease.acquire()
    print(lease.holder, lease.token, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture(scope="module")
def db(pg_dsn: str) -> Iterator[str]:
    with lease_database(pg_dsn) as dsn:
        yield dsn


@pytest.fixture
def dsn(db: str, app_name: str) -> Iterator[str]:
    yield with_app(db, app_name)
    _lease.shutdown()


@pytest.fixture
def admin(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def start_holder(
    db: str, app: str, name: str, ttl: float
) -> tuple[subprocess.Popen[str], str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, with_app(db, app), name, str(ttl)],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert len(line) == 2, f"holder failed (exit code {proc.poll()})"
    return proc, line[0], int(line[1])


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def gone(admin: psycopg.Connection[Any], app: str) -> bool:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
    ).fetchone()
    return row is not None and row[0] == 0


def test_a_killed_holder_lets_a_waiter_in_after_expiry_and_not_before(
    db: str, dsn: str, admin: psycopg.Connection[Any], app_name: str, name: str
) -> None:
    # acceptance: a holder process killed with SIGKILL lets a waiter in after expiry and not
    # before
    app = f"{app_name}:holder"
    proc, holder, token = start_holder(db, app, name, ttl=1.5)
    try:
        got: dict[str, Any] = {}

        def wait() -> None:
            lease = pglock.lease(dsn, name, ttl=5)
            got["ok"] = lease.acquire(timeout=30)
            got["lease"] = lease

        waiter = threading.Thread(target=wait)
        waiter.start()
        row = wait_until(lambda: (r := row_of(admin, name)) is not None and r[4] and r, 10)
        assert row and row[0] == holder  # the waiter is queued behind the live holder
    finally:
        kill(proc)
    # The dead holder's sessions are gone, so nothing renews the row any more: its expiry is
    # final now.
    assert wait_until(lambda: gone(admin, app), 10)
    final = row_of(admin, name)
    assert final is not None and final[0] == holder and final[1] == token
    waiter.join(30)
    lease = got["lease"]
    assert got["ok"] is True
    assert lease.acquired_at >= final[3]  # not before the expiry, on the database clock
    assert lease.token > token
    lease.release()


def test_resume_after_a_crash_reattaches_with_the_same_token(
    db: str, dsn: str, admin: psycopg.Connection[Any], app_name: str, name: str
) -> None:
    app = f"{app_name}:holder"
    proc, holder, token = start_holder(db, app, name, ttl=10)
    kill(proc)
    assert wait_until(lambda: gone(admin, app), 10)
    # The restarted process knows its holder id (saved somewhere) and re-attaches.
    with pglock.lease(dsn, name, holder=holder, resume=True, ttl=10) as lease:
        assert lease.token == token
        row = row_of(admin, name)
        assert row is not None and row[0] == holder and row[1] == token
    assert row_of(admin, name) is None
    # A crashed holder whose lease expired cannot resume it.
    proc, holder, token = start_holder(db, app, name, ttl=0.5)
    kill(proc)
    assert wait_until(lambda: gone(admin, app), 10)
    assert wait_until(lambda: (r := row_of(admin, name)) is not None and r[5], 10)
    with pytest.raises(pglock.LockLost):
        pglock.lease(dsn, name, holder=holder, resume=True).acquire()
