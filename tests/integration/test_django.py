"""Django connections (docs/django.md): pg_lock and xact_lock on ``django.db.connection``,
transaction.atomic() and its savepoints, persistent connections (CONN_MAX_AGE) and Django's
connection pool (OPTIONS "pool"), against the test server. Django is configured once per
process with settings.configure() (tests/_djangodb.py): no models, no test database."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import _djangodb
import psycopg
import pytest
from django.core.signals import request_finished, request_started
from django.db import DatabaseError, connection, connections, transaction

import pglock
from pglock import InvalidConnectionState, LockLost, LockNotAcquired

Connect = Callable[..., psycopg.Connection[Any]]


@pytest.fixture
def django_db(pg_dsn: str, app_name: str) -> Iterator[Any]:
    """Django's "default" alias on the test server (not connected yet), closed afterwards."""
    with _djangodb.database(pg_dsn, OPTIONS={"application_name": app_name}) as wrapper:
        yield wrapper


def held(observer: psycopg.Connection[Any], pid: int) -> set[int]:
    """The advisory keys (as pglock.key gives them) session ``pid`` holds."""
    rows = observer.execute(
        "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks"
        " WHERE locktype = 'advisory' AND pid = %s AND granted",
        (pid,),
    ).fetchall()
    return {k - (1 << 64) if k >= 1 << 63 else k for (k,) in rows}


def backend_pid(wrapper: Any) -> int:
    pid: int = wrapper.connection.info.backend_pid
    return pid


def test_pg_lock_on_the_connection_proxy(django_db: Any, other: psycopg.Connection[Any]) -> None:
    assert django_db.connection is None
    with pglock.pg_lock(connection, "dj:a") as lock:  # connects, as a query would
        pid = backend_pid(django_db)
        assert held(other, pid) == {pglock.key("dj:a")}
        assert lock.locked
    assert held(other, pid) == set()
    with pglock.pg_lock(connections["default"], "dj:b", timeout=0):  # the wrapper itself
        assert held(other, pid) == {pglock.key("dj:b")}
    assert held(other, pid) == set()


def test_xact_lock_outside_atomic_is_refused(
    django_db: Any, other: psycopg.Connection[Any]
) -> None:
    for call in (pglock.xact_lock, pglock.try_xact_lock):
        with pytest.raises(InvalidConnectionState, match=r"transaction\.atomic\(\)"):
            call(connection, "dj:x")
    assert held(other, backend_pid(django_db)) == set()


def test_xact_lock_ends_with_the_atomic_block(
    django_db: Any, other: psycopg.Connection[Any]
) -> None:
    key = pglock.key("dj:x")
    with transaction.atomic():
        pglock.xact_lock(connection, "dj:x")
        pid = backend_pid(django_db)
        assert held(other, pid) == {key}
    assert held(other, pid) == set()
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        assert pglock.try_xact_lock(connection, "dj:x")
        assert held(other, pid) == {key}
        1 / 0  # noqa: B018
    assert held(other, pid) == set()
    assert not connection.in_atomic_block and connection.get_autocommit()


def test_savepoint_rollback_releases_what_was_taken_in_it(
    django_db: Any, other: psycopg.Connection[Any]
) -> None:
    """Postgres releases a lock taken after a savepoint when it rolls back to it (docs: Explicit
    Locking), transaction-level advisory locks included."""
    outer, inner = pglock.key("dj:outer"), pglock.key("dj:inner")
    with transaction.atomic():
        pglock.xact_lock(connection, "dj:outer")
        pid = backend_pid(django_db)
        with pytest.raises(ZeroDivisionError), transaction.atomic():  # a savepoint
            pglock.xact_lock(connection, "dj:inner")
            assert held(other, pid) == {outer, inner}
            1 / 0  # noqa: B018
        assert held(other, pid) == {outer}
        with transaction.atomic():  # a savepoint released, not rolled back: kept
            pglock.xact_lock(connection, "dj:inner")
        assert held(other, pid) == {outer, inner}
        assert not connection.needs_rollback
    assert held(other, pid) == set()


def test_a_timeout_inside_atomic_leaves_the_transaction_usable(
    django_db: Any, other: psycopg.Connection[Any]
) -> None:
    other.execute("SELECT pg_advisory_lock(%s)", (pglock.key("dj:busy"),))
    try:
        with connection.cursor() as cur:
            cur.execute("CREATE TEMP TABLE dj_rows (x int)")
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("INSERT INTO dj_rows VALUES (1)")
            with pytest.raises(LockNotAcquired):
                pglock.xact_lock(connection, "dj:busy", timeout=0)
            assert not pglock.try_xact_lock(connection, "dj:busy")
            assert connection.in_atomic_block and not connection.needs_rollback
            with connection.cursor() as cur:
                cur.execute("INSERT INTO dj_rows VALUES (2)")
        # The timeout escaping the block rolls it back, as any exception does.
        with pytest.raises(LockNotAcquired), transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("INSERT INTO dj_rows VALUES (3)")
            pglock.xact_lock(connection, "dj:busy", timeout=0)
        with connection.cursor() as cur:
            cur.execute("SELECT array_agg(x ORDER BY x) FROM dj_rows")
            assert cur.fetchone() == ([1, 2],)
    finally:
        other.execute("SELECT pg_advisory_unlock_all()")


def test_a_block_that_must_roll_back_is_refused(django_db: Any) -> None:
    with transaction.atomic():
        with pytest.raises(ZeroDivisionError), transaction.atomic(savepoint=False):
            1 / 0  # noqa: B018
        assert connection.needs_rollback
        with pytest.raises(InvalidConnectionState, match="must be rolled back"):
            pglock.xact_lock(connection, "dj:x")
        with pytest.raises(InvalidConnectionState, match="must be rolled back"):
            pglock.pg_lock(connection, "dj:x")


def test_other_backends_are_refused_before_connecting(pg_dsn: str) -> None:
    psycopg2 = pytest.importorskip("psycopg2")
    with _djangodb.database(pg_dsn, alias="pglock_other") as wrapper:
        wrapper.Database = psycopg2  # what Django's backend has when only psycopg2 is installed
        with pytest.raises(TypeError, match=r"psycopg \(3\).*uses psycopg2"):
            pglock.pg_lock(wrapper, "dj:x")
        assert wrapper.connection is None  # nothing was sent, not even a connect
    _djangodb.configure()
    connections.settings["pglock_sqlite"] = connections.configure_settings(
        {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    )["default"]
    try:
        with pytest.raises(TypeError, match=r"PostgreSQL backend.*'sqlite'"):
            pglock.xact_lock(connections["pglock_sqlite"], "dj:x")
        assert connections["pglock_sqlite"].connection is None
    finally:
        _djangodb.forget("pglock_sqlite")


def test_another_threads_wrapper_is_refused_as_django_refuses_it(django_db: Any) -> None:
    errors: list[BaseException] = []

    def use() -> None:
        try:
            pglock.pg_lock(django_db, "dj:x")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=use)
    t.start()
    t.join(30)
    assert len(errors) == 1 and isinstance(errors[0], DatabaseError), errors
    assert django_db.connection is None


def _request(body: Callable[[], None]) -> None:
    """What Django's handler does around a view: the signals that close old connections."""
    request_started.send(sender=None)
    try:
        body()
    finally:
        request_finished.send(sender=None)


def test_persistent_connection_reset_at_request_end(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any]
) -> None:
    """CONN_MAX_AGE > 0 keeps the session, and a lock left held with it, into the next request;
    the documented request_finished receiver releases it."""
    options = {"application_name": app_name}
    leaked: list[Any] = []

    def leave_held() -> None:
        lock = pglock.pg_lock(connection, "dj:left")
        lock.acquire()
        leaked.append(lock)

    def receiver(**kwargs: Any) -> None:
        pglock.reset_connection(connection)

    with _djangodb.database(pg_dsn, CONN_MAX_AGE=60, OPTIONS=options) as wrapper:
        _request(leave_held)
        pid = backend_pid(wrapper)
        # Without a reset, the next request would start holding it (the negative control).
        assert held(other, pid) == {pglock.key("dj:left")}
        request_finished.connect(receiver, dispatch_uid="pglock-test")
        try:
            _request(lambda: None)
        finally:
            request_finished.disconnect(dispatch_uid="pglock-test")
        assert backend_pid(wrapper) == pid  # the same, persistent session
        assert held(other, pid) == set()
        with pytest.raises(LockLost):
            leaked[0].release()
    pglock.reset_connection(connection)  # not connected: nothing to do


def test_closed_at_request_end_by_default(
    django_db: Any, other: psycopg.Connection[Any]
) -> None:
    pids: list[int] = []

    def leave_held() -> None:
        pglock.pg_lock(connection, "dj:left").acquire()
        pids.append(backend_pid(django_db))

    _request(leave_held)  # CONN_MAX_AGE = 0: Django closes the connection, the session ends
    assert django_db.connection is None
    # The server ends a closed session a moment later: wait for it (bounded), then look.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and other.execute(
        "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pids[0],)
    ).fetchone():
        time.sleep(0.01)
    assert held(other, pids[0]) == set()


def test_django_pool_with_reset(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any]
) -> None:
    """OPTIONS "pool" with reset=pglock.reset_connection: a lock left held when Django gives
    the connection back is gone before the pool hands that connection out again."""
    pool = {"min_size": 1, "max_size": 1, "reset": pglock.reset_connection}
    options = {"application_name": app_name, "pool": pool}
    with _djangodb.database(pg_dsn, OPTIONS=options) as wrapper:
        lock = pglock.pg_lock(connection, "dj:left")
        lock.acquire()
        pid = backend_pid(wrapper)
        connection.close()  # back to Django's pool (the reset runs in a pool worker)
        with pglock.pool_lock(connections["default"], "dj:pooled", timeout=30) as conn:
            assert conn.info.backend_pid == pid  # the pool's only connection, reset
            assert held(other, pid) == {pglock.key("dj:pooled")}
        assert held(other, pid) == set()
        with pytest.raises(LockLost):
            lock.release()


def test_django_pool_without_reset_keeps_the_lock(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any]
) -> None:
    """The negative control of the test above: Django's pool alone resets nothing."""
    options = {"application_name": app_name, "pool": {"min_size": 1, "max_size": 1}}
    with _djangodb.database(pg_dsn, OPTIONS=options) as wrapper:
        pglock.pg_lock(connection, "dj:left").acquire()
        pid = backend_pid(wrapper)
        connection.close()
        connection.ensure_connection()
        assert backend_pid(wrapper) == pid
        assert held(other, pid) == {pglock.key("dj:left")}
        connection.cursor().execute("SELECT pg_advisory_unlock_all()")


def test_pool_lock_needs_a_pool(django_db: Any) -> None:
    with pytest.raises(TypeError, match="has no pool"):
        pglock.pool_lock(connection, "dj:x")
    with pytest.raises(TypeError, match=r"connections\[alias\]\.pool"):
        pglock.Locker(connection)
    assert django_db.connection is None


def test_singleton_on_the_connection(django_db: Any, connect: Connect) -> None:
    runs: list[int] = []

    @pglock.singleton(connection, "dj:job")
    def job() -> int:
        runs.append(1)
        return len(runs)

    assert job() == 1
    holder = connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (pglock.key("dj:job"),))
    assert job() is None  # another process runs it: skipped
    holder.execute("SELECT pg_advisory_unlock_all()")
    assert runs == [1]
