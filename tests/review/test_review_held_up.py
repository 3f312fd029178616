"""Attacks that held up: each asserts the documented behaviour, and passes."""

from __future__ import annotations

import enum
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from _review import held_keys, in_thread
from psycopg.rows import dict_row
from psycopg.types.bool import BoolLoader

import pglock

pytestmark = pytest.mark.timeout(60)


def _name() -> str:
    return f"review:{uuid.uuid4()}"


class Evil(str):
    """A str subclass overriding everything pglock must not consult."""

    def __str__(self) -> str:
        return "decoy"

    def __format__(self, spec: str) -> str:
        return "decoy"

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        return True

    def encode(self, *a: Any, **k: Any) -> bytes:  # type: ignore[override]
        return b"decoy"


def test_str_subclasses_and_enums_are_their_plain_value(installed: str, connect: Any) -> None:
    c, obs = connect(), connect()
    plain = _name()

    class Job(str, enum.Enum):
        X = plain

    for variant in (Evil(plain), Job.X, [Evil(plain)], (Job.X,), {Job.X}):
        with pglock.pg_lock(c, variant, timeout=0):
            assert held_keys(installed, [pglock.key(plain)])
            assert pglock.pg_lock(obs, plain, timeout=0).acquire() is False
    assert pglock.key(Evil(plain)) == pglock.key(plain)


def test_a_shadowing_search_path_decides_nothing(installed: str, connect: Any) -> None:
    """A schema before pg_catalog whose advisory-lock functions always answer true."""
    schema = f"review_shadow_{uuid.uuid4().hex[:8]}"
    admin = connect()
    admin.execute(f"CREATE SCHEMA {schema}")
    try:
        for fn in ("pg_try_advisory_lock", "pg_advisory_unlock", "pg_try_advisory_xact_lock"):
            admin.execute(
                f"CREATE FUNCTION {schema}.{fn}(bigint) RETURNS boolean"
                " LANGUAGE sql AS 'SELECT true'"
            )
        admin.execute(f"CREATE FUNCTION {schema}.unnest(bigint[]) RETURNS SETOF bigint"
                      " LANGUAGE sql AS 'SELECT 42::bigint'")
        c = connect(options=f"-c search_path={schema},pg_catalog")
        holder = connect()
        name = _name()
        with pglock.pg_lock(holder, name):
            assert pglock.pg_lock(c, name, timeout=0).acquire() is False
            assert pglock.pg_lock(c, [name, _name()], timeout=0).acquire() is False
            c2 = connect(autocommit=False, options=f"-c search_path={schema},pg_catalog")
            c2.execute("SELECT 1")
            assert pglock.try_xact_lock(c2, name) is False
            c2.rollback()
    finally:
        admin.execute(f"DROP SCHEMA {schema} CASCADE")


def test_row_factories_and_lying_loaders_change_no_answer(installed: str, connect: Any) -> None:
    class AlwaysTrue(BoolLoader):
        def load(self, data: Any) -> bool:
            return True

    c = connect(row_factory=dict_row)
    c.adapters.register_loader("bool", AlwaysTrue)
    holder = connect()
    name = _name()
    with pglock.pg_lock(holder, name):
        assert pglock.pg_lock(c, name, timeout=0).acquire() is False
        (lock,) = pglock.advisory_locks(c, name)
        assert lock.granted and lock.pid == holder.info.backend_pid


def test_pipeline_mode_is_refused_in_the_same_thread(installed: str, connect: Any) -> None:
    c = connect()
    name = _name()
    lock = pglock.pg_lock(c, name)
    assert lock.acquire()
    with c.pipeline():
        with pytest.raises(pglock.InvalidConnectionState):
            pglock.pg_lock(c, _name()).acquire()
        with pytest.raises(pglock.InvalidConnectionState):
            lock.release()
    assert held_keys(installed, [pglock.key(name)])
    lock.release()


def test_failed_transaction_defers_and_the_next_call_releases(installed: str, connect: Any) -> None:
    c = connect(autocommit=False)
    name = _name()
    with pytest.raises(psycopg.errors.DivisionByZero), pglock.pg_lock(c, name):
        c.execute("SELECT 1/0")
    assert held_keys(installed, [pglock.key(name)])  # deferred: the transaction failed
    with pytest.raises(pglock.InvalidConnectionState):
        pglock.pg_lock(c, _name()).acquire()
    c.rollback()
    with pglock.pg_lock(c, _name()):
        pass
    assert held_keys(installed, [pglock.key(name)]) == []
    assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_an_idle_non_autocommit_connection_is_left_idle(installed: str, connect: Any) -> None:
    c = connect(autocommit=False)
    name = _name()
    with pglock.pg_lock(c, [name, _name()], timeout=1):
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        pglock.advisory_locks(c, name)
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_the_callers_transaction_and_settings_survive_a_timed_out_attempt(
    installed: str, connect: Any
) -> None:
    c, holder = connect(autocommit=False), connect()
    name = _name()
    c.execute("CREATE TEMP TABLE review_t (x int)")
    c.execute("INSERT INTO review_t VALUES (1)")
    c.execute("SET LOCAL lock_timeout = '7s'")
    with pglock.pg_lock(holder, name):
        assert pglock.pg_lock(c, name, timeout=0.1).acquire() is False
        with pytest.raises(pglock.LockNotAcquired):
            pglock.xact_lock(c, [name, _name()], timeout=0.1)
    assert c.execute("SELECT count(*) FROM review_t").fetchone() == (1,)
    assert c.execute("SHOW lock_timeout").fetchone() == ("7s",)
    assert c.execute("SHOW statement_timeout").fetchone() == ("0",)
    c.rollback()


def test_threads_sharing_a_connection_never_overlap(installed: str, connect: Any) -> None:
    c = connect()
    name = _name()
    inside, overlaps = [0], [0]
    guard = threading.Lock()

    def worker() -> None:
        for _ in range(30):
            with pglock.pg_lock(c, name, timeout=10):
                with guard:
                    inside[0] += 1
                    if inside[0] > 1:
                        overlaps[0] += 1
                time.sleep(0.001)
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert overlaps[0] == 0
    assert held_keys(installed, [pglock.key(name)]) == []


def test_a_sql_injection_in_a_name_is_only_hashed(installed: str, connect: Any) -> None:
    c, obs = connect(), connect()
    evil = "x'); SELECT pg_advisory_unlock_all(); --$pglock$ \\' \x01"
    with pglock.pg_lock(c, evil):
        (lock,) = pglock.advisory_locks(obs, evil)
        assert lock.name == evil


def test_pool_lock_releases_a_lock_left_open_in_the_block(installed: str, pg_dsn: str,
                                                         app_name: str) -> None:
    from psycopg_pool import ConnectionPool

    name, inner = _name(), _name()
    with ConnectionPool(pg_dsn, min_size=1, max_size=1, kwargs={"application_name": app_name},
                        open=True) as pool:
        with pglock.pool_lock(pool, name) as conn:
            forgotten = pglock.pg_lock(conn, inner)
            assert forgotten.acquire()
        assert held_keys(pg_dsn, [pglock.key(name), pglock.key(inner)]) == []
        with pytest.raises(pglock.LockLost):
            forgotten.release()


def test_a_thread_waiting_in_process_is_woken_by_close(installed: str, connect: Any) -> None:
    c = connect()
    name = _name()
    with pglock.pg_lock(c, name):
        waiter = pglock.pg_lock(c, name)
        t, out = in_thread(waiter.acquire)
        time.sleep(0.2)
        waiter.close()
        t.join(5)
        assert out.get("result") is False
