"""Leases and dying holders: SIGKILL, then expiry (not earlier) or resume by holder id."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _pgdb import sa_url
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool
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


# --- lost source connections -------------------------------------------------------------------


def terminate_others(admin: psycopg.Connection[Any], app: str) -> int:
    """End every session of ``app`` but ``admin`` (waiting until each is gone)."""
    rows = admin.execute(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
        " WHERE application_name = %s AND pid <> pg_backend_pid()",
        (app,),
    ).fetchall()
    assert all(r[0] for r in rows), rows
    return len(rows)


@contextlib.contextmanager
def make_source(kind: str, dsn: str) -> Iterator[Any]:
    if kind == "dsn":
        yield dsn
    elif kind == "pool":
        with ConnectionPool(dsn, min_size=2, max_size=3, open=True) as pool:
            pool.wait(timeout=30)
            yield pool
    else:
        sa = pytest.importorskip("sqlalchemy")
        engine = sa.create_engine(sa_url(dsn), pool_size=2, max_overflow=0)
        try:
            yield engine
        finally:
            engine.dispose()


@pytest.mark.parametrize("kind", ["dsn", "pool", "engine"])
def test_lease_statements_replace_a_terminated_connection_once(
    kind: str,
    dsn: str,
    admin: psycopg.Connection[Any],
    app_name: str,
    name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The lease is a row, not a session: killing every backend of its source ends nothing.
    # The next statement meets a dead idle connection, and is sent once more on a live one.
    caplog.set_level(logging.WARNING, logger="pglock.lease")
    with make_source(kind, dsn) as source:
        lease = pglock.lease(source, name, ttl=30, keepalive=False)
        assert lease.acquire(timeout=0)
        token = lease.token
        ops: list[tuple[str, Callable[[], object]]] = [
            ("extend", lease.extend),
            ("acquire", lambda: pglock.lease(source, name, ttl=5).acquire(timeout=0)),
            ("acquire", lambda: _acquire_release(source, f"{name}:other")),
            ("release", lease.release),
        ]
        results = []
        for kind_of_statement, op in ops:
            assert terminate_others(admin, app_name) >= 1  # the source's idle connection(s)
            caplog.clear()
            results.append(op())
            # Not vacuous: the first attempt did meet a dead connection.
            lost = [r for r in caplog.records if "the connection was lost" in r.getMessage()]
            assert len(lost) == 1 and repr(kind_of_statement) in lost[0].getMessage()
            if kind_of_statement == "extend":
                row = row_of(admin, name)
                assert row is not None and (row[0], row[1]) == (lease.holder, token)
        assert results[1] is False  # still held by `lease`: refused, not an error
        assert results[2] is True
        assert row_of(admin, name) is None  # released


def _acquire_release(source: Any, name: str) -> bool:
    other = pglock.lease(source, name, ttl=5, keepalive=False)
    ok = other.acquire(timeout=0)
    other.release()
    return ok


def test_a_failed_retry_is_raised_and_the_keepalive_loses_the_lease_at_its_deadline(
    pg_dsn: str, app_name: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pglock.lease")
    with lease_database(pg_dsn) as db, psycopg.connect(pg_dsn, autocommit=True) as outside:
        dbname = str(conninfo_to_dict(db)["dbname"])
        dsn = with_app(db, app_name)
        lost = threading.Event()
        manual = pglock.lease(dsn, name, ttl=30, keepalive=False)
        kept = pglock.lease(dsn, f"{name}:kept", ttl=1.5, on_lost=lambda _lease: lost.set())
        assert manual.acquire(timeout=0) and kept.acquire(timeout=0)
        # Nobody can connect to the database any more, and its sessions are ended.
        outside.execute(
            sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(sql.Identifier(dbname))
        )
        try:
            assert terminate_others(outside, app_name) >= 1
            with pytest.raises(psycopg.OperationalError) as failed:
                manual.extend()
            # The second attempt's error, caused by the first one's, with a note saying so.
            assert isinstance(failed.value.__cause__, psycopg.errors.AdminShutdown)
            if sys.version_info >= (3, 11):
                assert any("failed again on a new connection" in n for n in failed.value.__notes__)
            # The keepalive's renewals fail the same way; the lease is lost at its deadline.
            assert lost.wait(10)
            assert kept.lost
            with pytest.raises(pglock.LockLost, match="TTL ran out"):
                kept.check()
        finally:
            outside.execute(
                sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(
                    sql.Identifier(dbname)
                )
            )
        # The row was never touched: the lease is still held, and the next statement works.
        with psycopg.connect(dsn, autocommit=True) as admin:
            row = row_of(admin, name)
            assert row is not None and (row[0], row[1]) == (manual.holder, manual.token)
            manual.release()
            assert row_of(admin, name) is None
        _lease.shutdown()
