"""Introspection of advisory locks by name, and the name registry that makes it possible.

Every test runs in a throwaway database (module scope) so that installing, revoking or reading
the registry never disturbs the other tests sharing the server.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import sa_url, throwaway_database
from _wire import RecordingConnection
from psycopg import sql

import pglock
from pglock import _registry

Connect = Callable[..., psycopg.Connection[Any]]


@pytest.fixture(scope="module")
def reg_dsn(pg_dsn: str) -> Iterator[str]:
    """A database with the pglock schema (and so the name registry) installed."""
    with throwaway_database(pg_dsn, prefix="pglock_inspect", install=True) as dsn:
        yield dsn


@pytest.fixture(scope="module")
def bare_dsn(pg_dsn: str) -> Iterator[str]:
    """A database without the pglock schema."""
    with throwaway_database(pg_dsn, prefix="pglock_bare", install=False) as dsn:
        yield dsn


@pytest.fixture
def open_(app_name: str) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    """Connect to any DSN with this test's application_name; closes everything afterwards."""
    opened: list[psycopg.Connection[Any]] = []

    def factory(dsn: str, *, record: bool = False, **kwargs: Any) -> psycopg.Connection[Any]:
        kwargs.setdefault("application_name", app_name)
        kwargs.setdefault("autocommit", True)
        if record:
            c: psycopg.Connection[Any] = RecordingConnection.connect(dsn, **kwargs)
        else:
            c = psycopg.connect(dsn, **kwargs)
        opened.append(c)
        return c

    yield factory
    for c in opened:
        c.close()


def registered(dsn: str, *names: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT key, name FROM pglock.lock_names WHERE key = ANY(%s)",
            ([pglock.key(n) for n in names],),
        ).fetchall()
    return {n: k for k, n in rows}


def uniq(prefix: str = "insp") -> str:
    return f"{prefix}:{uuid.uuid4().hex[:12]}"


# --- the registry ---------------------------------------------------------------------------


def test_every_kind_of_acquisition_registers_its_name(open_: Connect, reg_dsn: str) -> None:
    names = [uniq() for _ in range(9)]
    auto = open_(reg_dsn)
    with pglock.pg_lock(auto, names[0]):
        pass
    with pglock.pg_lock(auto, names[1], timeout=2):
        pass
    with pglock.pg_lock(auto, names[2], timeout=0):
        pass
    with pglock.pg_lock(auto, [names[3], names[4]]):
        pass
    tx = open_(reg_dsn, autocommit=False)
    with pglock.pg_lock(tx, names[5]):
        pass
    assert tx.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with tx.transaction():
        pglock.xact_lock(tx, names[6])
        pglock.xact_lock(tx, names[7], timeout=1)
        with pglock.pg_lock(tx, names[8], timeout=1):
            pass
    got = registered(reg_dsn, *names)
    assert got == {n: pglock.key(n) for n in names}


def test_registration_rides_in_the_lock_round_trip_once_per_process(
    open_: Connect, reg_dsn: str
) -> None:
    name = uniq()
    c = open_(reg_dsn, record=True)
    with pglock.pg_lock(c, uniq()):  # probe the connection first
        pass
    c.sent.clear()  # type: ignore[attr-defined]
    with pglock.pg_lock(c, name):
        pass
    first: list[str] = list(c.sent)  # type: ignore[attr-defined]
    c.sent.clear()  # type: ignore[attr-defined]
    with pglock.pg_lock(c, name):
        pass
    second: list[str] = list(c.sent)  # type: ignore[attr-defined]
    # Same number of round trips (lock, unlock); the first carries the registration.
    assert len(first) == len(second) == 2, (first, second)
    assert "INSERT INTO" in first[0] and "pg_advisory_lock" in first[0]
    assert not any("INSERT INTO" in s for s in second)
    assert registered(reg_dsn, name) == {name: pglock.key(name)}
    # A new connection in the same process does not register it again.
    other = open_(reg_dsn, record=True)
    with pglock.pg_lock(other, name):
        pass
    assert not any("INSERT INTO" in s for s in other.sent)  # type: ignore[attr-defined]


def test_names_met_faster_than_the_rate_go_out_in_batches(
    open_: Connect, reg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past RATE new names per second, names queue and ride together on a later lock
    statement once BATCH are queued; every cycle keeps its two round trips."""
    monkeypatch.setattr(_registry, "RATE", 2.0)
    monkeypatch.setattr(_registry, "BATCH", 4)
    monkeypatch.setattr(_registry, "MAX_DELAY", 60.0)
    c = open_(reg_dsn, record=True)
    with pglock.pg_lock(c, uniq()):  # probe the connection first
        pass
    _registry.clear()
    names = [uniq() for _ in range(6)]
    inserts = []
    for n in names:
        c.sent.clear()  # type: ignore[attr-defined]
        with pglock.pg_lock(c, n):
            pass
        sent: list[str] = list(c.sent)  # type: ignore[attr-defined]
        assert len(sent) == 2, sent
        inserts.append("INSERT INTO" in sent[0])
    # Two within the rate, each with its own lock; three queued; the fourth queued fills the
    # batch, which goes out with that lock statement.
    assert inserts == [True, True, False, False, False, True]
    assert registered(reg_dsn, *names) == {n: pglock.key(n) for n in names}


def test_queued_names_go_out_with_the_first_lock_after_max_delay(
    open_: Connect, reg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_registry, "RATE", 0.0)
    monkeypatch.setattr(_registry, "MAX_DELAY", 0.2)
    c = open_(reg_dsn)
    first, second = uniq(), uniq()
    with pglock.pg_lock(c, first):
        pass
    assert registered(reg_dsn, first) == {}
    time.sleep(0.25)
    with pglock.pg_lock(c, second):
        pass
    both = {first: pglock.key(first), second: pglock.key(second)}
    assert registered(reg_dsn, first, second) == both


def test_no_registration_without_the_schema(open_: Connect, bare_dsn: str) -> None:
    c = open_(bare_dsn, record=True)
    name = uniq()
    with pglock.pg_lock(c, name):
        pass
    with c.transaction():
        pglock.xact_lock(c, uniq())
    assert not any("INSERT INTO" in s for s in c.sent)  # type: ignore[attr-defined]
    assert pglock.advisory_locks(c, name) == []


def test_no_registration_without_insert_privilege(
    open_: Connect, reg_dsn: str, pg_dsn: str
) -> None:
    role = f"pglock_ro_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(reg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(sql.SQL("GRANT USAGE ON SCHEMA pglock TO {}").format(sql.Identifier(role)))
        admin.execute(
            sql.SQL("GRANT SELECT ON pglock.lock_names TO {}").format(sql.Identifier(role))
        )
    try:
        c = open_(reg_dsn, user=role, record=True)
        name = uniq()
        with pglock.pg_lock(c, name):
            (lk,) = pglock.advisory_locks(c, name)
            assert lk.name is None and lk.label == f"key {pglock.key(name)}"
        assert not any("INSERT INTO" in s for s in c.sent)  # type: ignore[attr-defined]
        c.close()
    finally:
        with psycopg.connect(reg_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_registration_leaves_the_callers_transaction_as_it_was(
    open_: Connect, reg_dsn: str
) -> None:
    c = open_(reg_dsn, autocommit=False)
    with c.transaction():
        c.execute("SET LOCAL lock_timeout = '7s'")
        with pglock.pg_lock(c, uniq()):
            pass
        pglock.xact_lock(c, uniq())
        assert c.execute("SHOW lock_timeout").fetchone() == ("7s",)
        # The caller's commit stays durable: only pglock's own transactions register
        # asynchronously.
        assert c.execute("SHOW synchronous_commit").fetchone() == ("on",)
        assert c.execute("SELECT 1").fetchone() == (1,)  # the transaction is usable
    assert c.execute("SHOW lock_timeout").fetchone() == ("0",)
    c.rollback()
    auto = open_(reg_dsn, record=True)
    with pglock.pg_lock(auto, uniq()):
        pass
    assert any("synchronous_commit" in s for s in auto.sent)  # type: ignore[attr-defined]
    assert auto.execute("SHOW synchronous_commit").fetchone() == ("on",)


def test_serializable_transactions_are_not_touched(open_: Connect, reg_dsn: str) -> None:
    c = open_(reg_dsn, autocommit=False)
    c.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    name = uniq()
    with c.transaction():
        pglock.xact_lock(c, name)
    assert registered(reg_dsn, name) == {}
    _registry.clear()  # the skipped registration was remembered as sent: try again elsewhere
    auto = open_(reg_dsn)
    with pglock.pg_lock(auto, name):
        pass
    assert registered(reg_dsn, name) == {name: pglock.key(name)}


def test_a_concurrent_uncommitted_registration_neither_blocks_nor_fails_the_lock(
    open_: Connect, reg_dsn: str
) -> None:
    """Session A registers a name inside its open transaction (uncommitted row); session B's
    registration of the same key would wait for A's commit: it gives up after 1 ms instead."""
    name = uniq()
    a = open_(reg_dsn, autocommit=False)
    b = open_(reg_dsn)
    a_lock = pglock.pg_lock(a, name, shared=True)
    a.execute("SELECT 1")  # A's transaction is open
    assert a_lock.acquire()
    _registry.clear()  # as if B were another process
    b_lock = pglock.pg_lock(b, name, shared=True)
    done = threading.Event()
    result: list[bool] = []

    def take() -> None:
        result.append(b_lock.acquire(timeout=10))
        done.set()

    t = threading.Thread(target=take, daemon=True)
    t.start()
    assert done.wait(10), "B's shared lock waited for A's transaction"
    t.join(5)
    assert result == [True]
    assert b.execute("SHOW lock_timeout").fetchone() == ("0",)
    b_lock.release()
    a_lock.release()
    a.commit()
    assert registered(reg_dsn, name) == {name: pglock.key(name)}


# --- advisory_locks ---------------------------------------------------------------------------


def wait_until(pred: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_holder_and_waiter_by_name(open_: Connect, reg_dsn: str, app_name: str) -> None:
    name = uniq("report")
    holder = open_(reg_dsn, application_name=f"{app_name}/holder")
    waiter = open_(reg_dsn, application_name=f"{app_name}/waiter")
    observer = open_(reg_dsn)
    lock = pglock.pg_lock(holder, name)
    assert lock.acquire()
    got = threading.Event()

    def wait_for_it() -> None:
        with pglock.pg_lock(waiter, name, timeout=20):
            got.set()

    t = threading.Thread(target=wait_for_it, daemon=True)
    t.start()
    try:
        wait_until(lambda: len(pglock.advisory_locks(observer, name)) == 2)
        held, waiting = pglock.advisory_locks(observer, name)

        assert held.name == waiting.name == name
        assert held.key == waiting.key == pglock.key(name)
        assert held.key_pair is None
        assert (held.granted, waiting.granted) == (True, False)
        assert (held.mode, waiting.mode) == ("exclusive", "exclusive")
        assert held.pid == holder.info.backend_pid
        assert waiting.pid == waiter.info.backend_pid
        assert held.application_name == f"{app_name}/holder"
        assert waiting.application_name == f"{app_name}/waiter"
        # TCP, or a Unix socket (no address; Postgres reports port -1)
        assert held.client_addr is not None or held.client_port in (None, -1)
        assert held.held_since is not None and held.held_for is not None
        assert held.held_since_basis == "statement"
        assert held.held_since >= held.backend_start  # type: ignore[operator]
        assert held.waiting_since is None and held.waiting_for is None
        assert waiting.held_since is None and waiting.held_for is None
        assert waiting.blocked_by == (holder.info.backend_pid,)
        if holder.info.server_version >= 140000:
            wait_until(lambda: pglock.advisory_locks(observer, name)[-1].waiting_since is not None)
            waiting = pglock.advisory_locks(observer, name)[-1]
            assert waiting.waiting_since is not None and waiting.waiting_for is not None
            assert waiting.waiting_since <= waiting.observed_at
            assert waiting.waiting_for >= 0
        else:  # pg_locks.waitstart is new in 14
            assert waiting.waiting_since is None
        assert held.label == name
    finally:
        # Never leave the waiter thread running on a connection the teardown closes.
        lock.release()
        t.join(10)
    assert got.is_set()


def test_held_for_grows_and_its_basis_is_honest(open_: Connect, reg_dsn: str) -> None:
    name = uniq()
    holder = open_(reg_dsn)
    observer = open_(reg_dsn)
    with pglock.pg_lock(holder, name):
        first = pglock.advisory_locks(observer, name)[0]
        # The held_for of two snapshots grows by the server time between them.
        observer.execute("SELECT pg_sleep(0.05)")
        second = pglock.advisory_locks(observer, name)[0]
        assert first.held_since == second.held_since
        assert second.held_for > first.held_for  # type: ignore[operator]
        assert first.held_since_basis == "statement"
        # Once the holder runs another statement, only the session start bounds the age.
        holder.execute("SELECT 1")
        third = pglock.advisory_locks(observer, name)[0]
        assert third.held_since_basis == "session"
        assert third.held_since == third.backend_start
        assert third.held_since <= first.held_since  # type: ignore[operator]


def test_fast_path_statement_is_attributed_only_when_unambiguous(
    open_: Connect, reg_dsn: str
) -> None:
    a, b = uniq(), uniq()
    holder = open_(reg_dsn)
    observer = open_(reg_dsn)
    with pglock.pg_lock(holder, a), pglock.pg_lock(holder, b):
        # Twice-used names take the parameterized fast path: the text does not say which key
        # the latest statement took, and the session holds two, so neither is attributed.
        pass
    with pglock.pg_lock(holder, a), pglock.pg_lock(holder, b):
        locks = {lk.name: lk for lk in pglock.advisory_locks(observer, [a, b])}
        assert {lk.held_since_basis for lk in locks.values()} == {"session"}
    with pglock.pg_lock(holder, a):
        (lk,) = pglock.advisory_locks(observer, a)
        assert lk.held_since_basis == "statement"


def test_shared_holders_unregistered_keys_and_two_int_keys(
    open_: Connect, reg_dsn: str
) -> None:
    name = uniq()
    one, two = open_(reg_dsn), open_(reg_dsn)
    observer = open_(reg_dsn)
    raw = open_(reg_dsn)
    with pglock.pg_lock(one, name, shared=True), pglock.pg_lock(two, name, shared=True):
        locks = pglock.advisory_locks(observer, name)
        assert [(lk.mode, lk.granted) for lk in locks] == [("shared", True)] * 2
        assert {lk.pid for lk in locks} == {one.info.backend_pid, two.info.backend_pid}
    raw.execute("SELECT pg_advisory_lock(12345678901), pg_advisory_lock(-7, 42)")
    try:
        mine = [lk for lk in pglock.advisory_locks(observer) if lk.pid == raw.info.backend_pid]
        by_label = {lk.label: lk for lk in mine}
        assert set(by_label) == {"key 12345678901", "keys (-7, 42)"}
        assert by_label["key 12345678901"].name is None
        assert by_label["keys (-7, 42)"].key is None
        assert by_label["keys (-7, 42)"].key_pair == (-7, 42)
        # The latest statement names both keys: attributed.
        assert {lk.held_since_basis for lk in mine} == {"statement"}
    finally:
        raw.execute("SELECT pg_advisory_unlock_all()")


def test_negative_and_extreme_keys_round_trip(open_: Connect, reg_dsn: str) -> None:
    raw, observer = open_(reg_dsn), open_(reg_dsn)
    keys = [-(2**63), 2**63 - 1, -1, 0, 2**32, -(2**32)]
    raw.execute("SELECT pg_advisory_lock(k) FROM unnest(%s::bigint[]) k", (keys,))
    try:
        mine = {lk.key for lk in pglock.advisory_locks(observer) if lk.pid == raw.info.backend_pid}
        assert mine == set(keys)
    finally:
        raw.execute("SELECT pg_advisory_unlock_all()")


def test_only_the_current_database(open_: Connect, reg_dsn: str, bare_dsn: str) -> None:
    name = uniq()
    elsewhere = open_(bare_dsn)
    observer = open_(reg_dsn)
    with pglock.pg_lock(elsewhere, name):
        assert pglock.advisory_locks(observer, name) == []
        assert len(pglock.advisory_locks(open_(bare_dsn), name)) == 1


def test_idle_connection_stays_idle_and_bad_input(open_: Connect, reg_dsn: str) -> None:
    c = open_(reg_dsn, autocommit=False)
    pglock.advisory_locks(c)
    assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with c.transaction():
        c.execute("SELECT 1")
        pglock.advisory_locks(c)
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    with pytest.raises(ValueError):
        pglock.advisory_locks(c, "")
    with pytest.raises(TypeError):
        pglock.advisory_locks(c, 42)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pglock.advisory_locks("postgresql://nope")
    assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_sqlalchemy_session(reg_dsn: str, app_name: str) -> None:
    sa = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    engine = sa.create_engine(sa_url(reg_dsn, application_name=app_name))
    name = uniq()
    try:
        with Session(engine) as session:
            pglock.xact_lock(session, name)
            (lk,) = pglock.advisory_locks(session, name)
            assert lk.name == name and lk.application_name == app_name
            session.commit()
    finally:
        engine.dispose()


def test_registry_only_in_the_configured_schema_and_lookalikes_ignored(
    open_: Connect, pg_dsn: str
) -> None:
    """The registry is ``<schema>.lock_names`` of the configured schema, never a table found
    by name elsewhere (issue 11 item 3). This test used to pin the opposite: a schema installed
    as ``locks`` was found by name and written by ``pg_lock``. The lock APIs take no schema, so
    they register in the default schema (``pglock``) only; ``advisory_locks(schema=...)`` reads
    the registry of the schema it is given."""
    from pglock import _schema

    with throwaway_database(pg_dsn, prefix="pglock_custom", install=False) as dsn:
        with psycopg.connect(dsn, autocommit=True) as admin:
            # A table of the same name that is not pglock's, in a schema that sorts first: never
            # written, never read.
            admin.execute("CREATE SCHEMA aaa")
            admin.execute("CREATE TABLE aaa.lock_names (key bigint PRIMARY KEY, name text)")
        _schema.install(dsn, schema="locks")
        c, observer = open_(dsn), open_(dsn)
        name = uniq()
        with pglock.pg_lock(c, name):
            (lk,) = pglock.advisory_locks(observer, name)
            assert lk.name is None  # the default schema is not installed
        with psycopg.connect(dsn, autocommit=True) as admin:
            assert admin.execute("SELECT count(*) FROM aaa.lock_names").fetchone() == (0,)
            assert admin.execute("SELECT count(*) FROM locks.lock_names").fetchone() == (0,)
            admin.execute(
                "INSERT INTO locks.lock_names (key, name) VALUES (%s, %s)", (pglock.key(name), name)
            )
        with pglock.pg_lock(c, name):
            (lk,) = pglock.advisory_locks(observer, name, schema="locks")
            assert lk.name == name
            (lk,) = pglock.advisory_locks(observer, name)
            assert lk.name is None
        _schema.install(dsn)  # the default schema: connections probed from now on register
        fresh, other = open_(dsn), uniq()
        with pglock.pg_lock(fresh, other):
            (lk,) = pglock.advisory_locks(observer, other)
            assert lk.name == other
        with psycopg.connect(dsn, autocommit=True) as admin:
            assert admin.execute("SELECT count(*) FROM aaa.lock_names").fetchone() == (0,)
            assert admin.execute("SELECT name FROM locks.lock_names").fetchall() == [(name,)]
            assert admin.execute("SELECT name FROM pglock.lock_names").fetchall() == [(other,)]
            c.close()
            fresh.close()
            observer.close()
