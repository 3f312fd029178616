"""Security, advisory side (issue 6 item 4), and the fault side of T26 (bad inputs).

* Injection attempts in names and namespaces are harmless: names are only hashed, so pg_locks
  shows exactly the lock asked for and nothing else changed; schema names outside the
  accepted pattern are rejected before any SQL.
* Nothing secret is logged: with a password in the DSN, no log record, exception message or
  repr that pglock produces contains it, on the success paths and on the error paths.

The main bad-input table (85 cases) is tests/integration/test_bad_input.py.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from _pgdb import with_params
from psycopg import sql

import pglock

from .oracles import truth, wait_for, waiters

Connect = Callable[..., psycopg.Connection[Any]]

INJECTIONS = [
    "x'); SELECT pg_advisory_unlock_all();--",
    "'; DROP TABLE {table}; --",
    '"; DROP TABLE {table}; --',
    "$1",
    "%s",
    "%(name)s",
    "{}",
    "\\'",
    "E'\\\\' OR 1=1",
    "/* */ SELECT pg_terminate_backend(pg_backend_pid())",
    "\n;COMMIT;SELECT 1;",
    "lock\r\nSET lock_timeout = 1",
    "名前🔒",
    "\uff21' OR '\uff41'='\uff41",  # fullwidth letters
]


@pytest.mark.parametrize("template", INJECTIONS)
def test_T26_injection_in_names_is_harmless(
    template: str,
    connect: Connect,
    observer: psycopg.Connection[Any],
    scratch: sql.Identifier,
) -> None:
    table = scratch.as_string(observer)
    evil = template.replace("{table}", table)
    sentinel = f"sentinel:{uuid.uuid4()}"
    conn = connect()
    pid = conn.info.backend_pid
    with pglock.pg_lock(conn, sentinel):
        base = {pglock.key(sentinel): "x"}
        with pglock.pg_lock(conn, evil):
            assert truth(observer, pid) == {**base, pglock.key(evil): "x"}
        with pglock.pg_lock(conn, [evil, evil + ":2"], shared=True):
            assert truth(observer, pid) == {
                **base,
                pglock.key(evil): "s",
                pglock.key(evil + ":2"): "s",
            }
        with pglock.pg_lock(conn, evil, timeout=0.5):
            assert truth(observer, pid) == {**base, pglock.key(evil): "x"}
        with conn.transaction():
            pglock.xact_lock(conn, evil, timeout=0.5)
            assert pglock.try_xact_lock(conn, evil + ":try")
            assert truth(observer, pid) == {
                **base,
                pglock.key(evil): "x",
                pglock.key(evil + ":try"): "x",
            }
        assert truth(observer, pid) == base
    assert truth(observer, pid) == {}
    assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
    # The table the injection names is still there.
    assert observer.execute(sql.SQL("SELECT count(*) FROM {}").format(scratch)).fetchone() == (0,)


def test_T26_injection_in_namespace_and_schema(
    pg_dsn: str, app_name: str, observer: psycopg.Connection[Any], scratch: sql.Identifier
) -> None:
    table = scratch.as_string(observer)
    for schema in [f'public"; DROP TABLE {table}; --', "a.b", "x" * 64, "Pglock", "pg_temp"]:
        with pytest.raises((ValueError, TypeError)):
            pglock.Locker(pg_dsn, schema=schema)
    evil_ns = f"ns'); DROP TABLE {table}; --"
    pool_mod = pytest.importorskip("psycopg_pool")
    with pool_mod.ConnectionPool(
        pg_dsn,
        min_size=1,
        max_size=1,
        kwargs={"autocommit": True, "application_name": app_name},
        reset=pglock.reset_connection,
    ) as pool:
        locker = pglock.Locker(pool, namespace=evil_ns)
        with locker.lock("job") as c:
            assert truth(observer, c.info.backend_pid) == {pglock.key(f"{evil_ns}:job"): "x"}
    assert observer.execute(sql.SQL("SELECT count(*) FROM {}").format(scratch)).fetchone() == (0,)


# --- nothing secret is logged ---------------------------------------------------------------------


def with_password(dsn: str, password: str) -> str:
    """The same DSN with a password (the test server trusts, so any password works)."""
    return with_params(dsn, password=password)


Seen = Callable[[object], None]


def _timeouts_and_fail_fast(
    a: psycopg.Connection[Any], b: psycopg.Connection[Any], name: str, seen: Seen
) -> None:
    """A held lock, then on another session: a timeout, a fail-fast, a failed transaction's
    deferred release."""
    lock = pglock.pg_lock(a, name)
    seen(lock)
    assert lock.acquire()
    seen(lock)
    for attempt in (
        lambda: pglock.pg_lock(b, name, timeout=0.05).acquire(),
        lambda: pglock.pg_lock(b, name, timeout=0).acquire(),
    ):
        assert attempt() is False
    try:
        with b.transaction():
            pglock.xact_lock(b, name, timeout=0.05)
    except pglock.LockNotAcquired as exc:
        seen(exc)
    lock.release()


def _deadlock(connect: Connect, observer: psycopg.Connection[Any], name: str, seen: Seen) -> None:
    c1, c2 = connect(), connect()
    l1, l2 = pglock.pg_lock(c1, name + ":1"), pglock.pg_lock(c2, name + ":2")
    assert l1.acquire() and l2.acquire()
    errs: list[BaseException] = []

    def cross() -> None:
        try:
            got = pglock.pg_lock(c1, name + ":2", timeout=10)
            if got.acquire():
                got.release()
        except BaseException as exc:
            errs.append(exc)
        finally:
            l1.release()

    t = threading.Thread(target=cross)
    t.start()
    wait_for(lambda: c1.info.backend_pid in waiters(observer, pglock.key(name + ":2")))
    try:
        other = pglock.pg_lock(c2, name + ":1", timeout=10)
        if other.acquire():
            other.release()
    except pglock.DeadlockDetected as exc:
        seen(exc)
    l2.release()
    t.join(10)
    assert not t.is_alive()
    for e in errs:
        seen(e)


def _lost_lock(connect: Connect, observer: psycopg.Connection[Any], name: str, seen: Seen) -> None:
    """A lost lock (backend terminated)."""
    victim = connect()
    lost = pglock.pg_lock(victim, name + ":lost")
    assert lost.acquire()
    observer.execute("SELECT pg_terminate_backend(%s, 5000)", (victim.info.backend_pid,))
    with pytest.raises(pglock.LockLost) as info:
        lost.release()
    seen(info.value)


def _pool_and_locker(dsn: str, app_name: str, name: str, seen: Seen) -> None:
    """A pool reset that finds a leaked lock, pool_lock, and Lockers on a pool and a DSN."""
    pool_mod = pytest.importorskip("psycopg_pool")
    with pool_mod.ConnectionPool(
        dsn,
        min_size=1,
        max_size=1,
        kwargs={"autocommit": True, "application_name": app_name},
        reset=pglock.reset_connection,
    ) as pool:
        pc = pool.getconn()
        seen(pc)
        pc.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name + ":leak"),))
        pool.putconn(pc)
        with pglock.pool_lock(pool, name + ":pool", timeout=1) as c:
            seen(c)
        locker = pglock.Locker(pool, namespace="sec")
        seen(locker)
    locker = pglock.Locker(dsn, namespace="sec")
    seen(locker)
    with locker.lock("x", timeout=5):
        pass
    locker.close()


def _leaks(records: list[logging.LogRecord], extra: list[str], secret: str) -> list[str]:
    """The texts (``extra``, and every record's message and traceback) that contain
    ``secret``."""
    out = list(extra)
    for record in records:
        out.append(record.getMessage())
        if record.exc_info:
            out.append(logging.Formatter().formatException(record.exc_info))
    return [t for t in out if secret in t]


def test_security_no_password_in_logs_or_errors(
    pg_dsn: str,
    app_name: str,
    name: str,
    observer: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    dsn = with_password(pg_dsn, secret)
    caplog.set_level(logging.DEBUG, logger="pglock")
    texts: list[str] = []

    def seen(obj: object) -> None:
        texts.append(str(obj))
        texts.append(repr(obj))

    conns: list[psycopg.Connection[Any]] = []

    def connect(**kw: Any) -> psycopg.Connection[Any]:
        c = psycopg.connect(dsn, autocommit=kw.pop("autocommit", True), application_name=app_name)
        conns.append(c)
        return c

    try:
        a, b = connect(), connect()
        assert a.info.password == secret  # the secret was there to be leaked
        # A timeout, a fail-fast, a failed transaction's deferred release.
        _timeouts_and_fail_fast(a, b, name, seen)
        # A deadlock.
        _deadlock(connect, observer, name, seen)
        # A lost lock (backend terminated) and a pool reset that finds a leaked lock.
        _lost_lock(connect, observer, name, seen)
        _pool_and_locker(dsn, app_name, name, seen)
    finally:
        for c in conns:
            c.close()

    assert caplog.records, "the scenario should have logged something"

    assert _leaks(caplog.records, texts, secret) == []
    # Negative control: the same check finds a secret that a careless log line would expose.
    careless = logging.LogRecord(
        "pglock", logging.DEBUG, __file__, 0, "connecting to %s", (dsn,), None
    )
    assert _leaks([careless], [], secret) != []
