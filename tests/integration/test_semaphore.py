"""Semaphores: the limit holds across processes with weighted permits, the limit is stored,
a killed holder's permits come back, and waiters wake on the release NOTIFY.

Run as a script (``python test_semaphore.py worker|holder ...``) this file is one of the
processes of the multi-process tests.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import ConnectionPool

import pglock
from pglock import _semaphore, _source, _waiting
from pglock._schema import install

ROOT = Path(__file__).resolve().parents[2]
Connect = Callable[..., psycopg.Connection[Any]]


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def schema(pg_dsn: str) -> Iterator[str]:
    """A pglock schema of this module's own in the shared database (other helpers install
    and drop the default one)."""
    name = f"t5sem_{uuid.uuid4().hex[:8]}"
    install(pg_dsn, schema=name)
    try:
        yield name
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def dsn(pg_dsn: str, app_name: str) -> str:
    return make_conninfo(pg_dsn, application_name=app_name)


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    p: ConnectionPool[Any] = ConnectionPool(dsn, min_size=1, max_size=6,
                                            kwargs={"autocommit": True}, open=True)
    try:
        yield p
    finally:
        p.close()


def permit_rows(conn: psycopg.Connection[Any], schema: str, name: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        sql.SQL("SELECT holder, permits FROM {}.semaphore_permit WHERE semaphore = %s"
                " AND expires_at > clock_timestamp() ORDER BY holder").format(
            sql.Identifier(schema)), (name,)
    ).fetchall()


def test_revision_round_trip(pg_dsn: str) -> None:
    """pglock_0002 downgrades cleanly (after the revisions above it), leaves the leases alone,
    installs again, and re-running its statements is harmless."""
    from pglock._schema import installed_revisions, revisions

    schema = f"t5rt_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(schema)
    install(pg_dsn, schema=schema)
    revs = revisions()
    names = [r.revision for r in revs]
    assert names.index("pglock_0002") == names.index("pglock_0001") + 1
    mine = revs[names.index("pglock_0002")]

    def tables(c: psycopg.Connection[Any]) -> set[str]:
        return {r[0] for r in c.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)).fetchall()}

    try:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(sql.SQL("SELECT * FROM {}.semaphore_acquire('x', 2, 'h', 1, 60)")
                      .format(ident))
            with c.transaction():  # idempotent: the statements again change nothing
                for st in mine.upgrade_statements(schema):
                    c.execute(st)
            assert c.execute(sql.SQL("SELECT held FROM {}.semaphore_info('x')").format(ident)
                             ).fetchone() == (1,)
            # A downgrade refuses to drop live permits (T28): give this one back first.
            c.execute(sql.SQL("SELECT {}.semaphore_release('x', 'h')").format(ident))
            with c.transaction():
                for rev in reversed(revs[names.index("pglock_0002"):]):
                    for st in rev.module.downgrade_statements(schema):
                        c.execute(st)
            assert {"semaphore", "semaphore_permit"}.isdisjoint(tables(c))
            assert {"lease", "schema_revision"} <= tables(c)
            assert installed_revisions(c, schema) == ["pglock_0001"]
            assert c.execute(
                "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = %s AND p.proname LIKE 'semaphore%%'", (schema,)
            ).fetchone() == (0,)
        assert install(pg_dsn, schema=schema) == names[names.index("pglock_0002"):]
        assert install(pg_dsn, schema=schema) == []
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(ident))


# --- basics ------------------------------------------------------------------------------------


def test_acquire_release_count_and_weights(
    pool: ConnectionPool[Any], schema: str, name: str, conn: psycopg.Connection[Any]
) -> None:
    sem = pglock.semaphore(pool, name, 3, schema=schema)
    assert sem.count() == 0  # never used: nothing stored yet
    with sem:
        assert sem.count() == 1
        with sem.hold(permits=2, timeout=0) as permit:
            assert permit.locked and permit.permits == 2
            assert sem.count() == 3
            assert sorted(p for _, p in permit_rows(conn, schema, name)) == [1, 2]
            assert not sem.acquire(timeout=0)
            with pytest.raises(pglock.LockNotAcquired), sem.hold(timeout=0.2):
                pass
        assert sem.count() == 1
        assert sem.acquire(permits=2, timeout=0)
        sem.release()
    assert sem.count() == 0
    with pytest.raises(RuntimeError):
        sem.release()
    assert permit_rows(conn, schema, name) == []
    row = conn.execute(sql.SQL("SELECT max_permits FROM {}.semaphore WHERE name = %s").format(
        sql.Identifier(schema)), (name,)).fetchone()
    assert row == (3,)


def test_mismatched_limit_is_a_clear_error(
    pool: ConnectionPool[Any], schema: str, name: str
) -> None:
    first = pglock.semaphore(pool, name, 3, schema=schema)
    with first:
        pass
    other = pglock.semaphore(pool, name, 5, schema=schema)
    with pytest.raises(pglock.LimitMismatch) as info:
        other.acquire()
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, pglock.LockError)
    assert (err.name, err.limit, err.stored_limit) == (name, 5, 3)
    assert "limit 3" in str(err) and "limit=5" in str(err)
    with pytest.raises(pglock.LimitMismatch), other.hold(timeout=0):
        pass
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert (again.stored_limit, str(again)) == (3, str(err))


def test_bad_arguments_fail_before_sql(pool: ConnectionPool[Any], schema: str) -> None:
    with pytest.raises(ValueError):
        pglock.semaphore(pool, "n", 0)
    with pytest.raises(TypeError):
        pglock.semaphore(pool, "n", True)
    with pytest.raises(TypeError):
        pglock.semaphore(pool, "n", 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pglock.semaphore(pool, "n", 2, ttl=0)
    with pytest.raises(ValueError):
        pglock.semaphore(pool, "n", 2, ttl=float("nan"))
    with pytest.raises(ValueError):
        pglock.semaphore(pool, "n", 2, schema="Bad-Schema")
    with pytest.raises(ValueError):
        pglock.semaphore(pool, "", 2)
    with pytest.raises(TypeError):
        pglock.semaphore(object(), "n", 2)
    with pytest.raises(TypeError):
        pglock.semaphore(pool, "n", 2, metadata={1, 2})
    sem = pglock.semaphore(pool, "n", 2, schema=schema)
    with pytest.raises(ValueError, match="never be granted"):
        sem.acquire(permits=3)
    with pytest.raises(ValueError):
        sem.acquire(permits=0)
    with pytest.raises(ValueError):
        sem.hold(timeout=-1)


def test_connection_sources_are_refused(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(TypeError, match="connections of its own"):
        pglock.semaphore(conn, "n", 2)


def test_schema_not_installed(pool: ConnectionPool[Any], name: str) -> None:
    sem = pglock.semaphore(pool, name, 2, schema="pglock_absent_schema")
    with pytest.raises(pglock.SchemaNotInstalled):
        sem.acquire()


def test_repeatable_read_default_is_safe(dsn: str, schema: str, name: str) -> None:
    rr = make_conninfo(dsn, options="-c default_transaction_isolation=repeatable\\ read")
    sem = pglock.semaphore(rr, name, 1, schema=schema)
    with sem:
        assert not pglock.semaphore(rr, name, 1, schema=schema).acquire(timeout=0)
    _source._dsn_sources.pop(rr).close()


def test_locker_and_engine_sources(
    pool: ConnectionPool[Any], dsn: str, schema: str, name: str, conn: psycopg.Connection[Any]
) -> None:
    sa = pytest.importorskip("sqlalchemy")
    locker = pglock.Locker(pool, namespace="semtest", schema=schema)
    sem = locker.semaphore(name, limit=2)
    assert sem.name == f"semtest:{name}"
    engine = sa.create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    try:
        via_engine = pglock.semaphore(engine, f"semtest:{name}", 2, schema=schema)
        with sem, via_engine:
            assert len(permit_rows(conn, schema, f"semtest:{name}")) == 2
            assert not sem.acquire(timeout=0)
            # A waiter through the engine LISTENs on a connection of its own.
            assert not via_engine.acquire(timeout=0.1)
            channel = _semaphore.semaphore_channel(schema)
            listener = _waiting.waiters.listeners[(("engine", id(engine)), schema, channel)]
            assert listener.healthy
        via_engine.close()
    finally:
        engine.dispose()


def _terminate_others(admin: psycopg.Connection[Any], app: str) -> int:
    """End every session of this test's ``app`` but ``admin`` (waiting until each is gone)."""
    rows = admin.execute(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
        " WHERE application_name = %s AND pid <> pg_backend_pid()",
        (app,),
    ).fetchall()
    assert all(r[0] for r in rows), rows
    return len(rows)


@pytest.mark.parametrize("kind", ["dsn", "pool", "engine"])
def test_statements_replace_a_terminated_connection_once(
    kind: str, dsn: str, pool: ConnectionPool[Any], schema: str, name: str, app_name: str,
    conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture,
) -> None:
    # The idle connections of the source die (their backends terminated): the next acquire and
    # release each meet a dead connection and are sent once more on a live one.
    caplog.set_level(logging.WARNING, logger="pglock.semaphore")
    engine = None
    source: Any = pool if kind == "pool" else dsn
    if kind == "engine":
        sa = pytest.importorskip("sqlalchemy")
        engine = source = sa.create_engine(
            "postgresql+psycopg://", creator=lambda: psycopg.connect(dsn), pool_size=2
        )
    try:
        sem = pglock.semaphore(source, name, 2, schema=schema)
        assert sem.count() == 0  # leaves an idle connection in the source
        for op in ("acquire", "release"):
            assert _terminate_others(conn, app_name) >= 1
            caplog.clear()
            if op == "acquire":
                assert sem.acquire(permits=2, timeout=0)
                assert sum(p for _, p in permit_rows(conn, schema, name)) == 2
            else:
                sem.release()  # no LockLost: the first attempt never reached the server
                assert permit_rows(conn, schema, name) == []
            # Not vacuous: the first attempt did meet a dead connection.
            lost = [r for r in caplog.records if "the connection was lost" in r.getMessage()]
            assert len(lost) == 1 and repr(op) in lost[0].getMessage(), lost
        sem.close()
    finally:
        if engine is not None:
            engine.dispose()


def test_lost_permit_is_reported(pool: ConnectionPool[Any], schema: str, name: str,
                                 conn: psycopg.Connection[Any]) -> None:
    sem = pglock.semaphore(pool, name, 2, ttl=0.6, schema=schema)
    permit = sem.hold().__enter__()
    try:
        # Somebody deletes the row (as an expiry during a long pause would): the keepalive
        # finds it gone, and the holder hears of it.
        conn.execute(sql.SQL("DELETE FROM {}.semaphore_permit WHERE semaphore = %s").format(
            sql.Identifier(schema)), (name,))
        wait_until(lambda: not permit.locked, 5, "the keepalive to notice")
        with pytest.raises(pglock.LockLost):
            permit.check()
    finally:
        with pytest.raises(pglock.LockLost):
            permit.release()


def test_keepalive_keeps_permits_past_their_ttl(pool: ConnectionPool[Any], schema: str,
                                                name: str,
                                                conn: psycopg.Connection[Any]) -> None:
    sem = pglock.semaphore(pool, name, 1, ttl=1, schema=schema)
    with sem.hold() as permit:
        first = conn.execute(sql.SQL("SELECT expires_at FROM {}.semaphore_permit"
                                     " WHERE holder = %s").format(sql.Identifier(schema)),
                             (permit.holder,)).fetchone()
        time.sleep(2.2)  # more than two TTLs
        permit.check()
        later = conn.execute(sql.SQL("SELECT expires_at FROM {}.semaphore_permit"
                                     " WHERE holder = %s").format(sql.Identifier(schema)),
                             (permit.holder,)).fetchone()
        assert first is not None and later is not None and later[0] > first[0]


def count_attempts(sem: pglock.Semaphore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The acquire statements ``sem`` sends, counted by a test double over its attempt."""
    sent = [0]
    attempt = sem._try

    def counted(*args: Any, **kwargs: Any) -> Any:
        sent[0] += 1
        return attempt(*args, **kwargs)

    monkeypatch.setattr(sem, "_try", counted)
    return sent


# --- waking ------------------------------------------------------------------------------------


def test_waiters_wake_on_release_notify_not_a_poll(
    pool: ConnectionPool[Any], schema: str, name: str, monkeypatch: pytest.MonkeyPatch,
    conn: psycopg.Connection[Any], app_name: str,
) -> None:
    """The fallback poll is pushed out to a minute and the holder's expiry is 30 s away:
    only the NOTIFY of the release can wake the waiter in time.

    A refused waiter subscribes to the NOTIFY channel and tries once more (a release before
    its LISTEN was active would go unheard), then sleeps: two refused attempts, and the
    third, after the release, is granted."""
    monkeypatch.setattr(_waiting, "FALLBACK_POLL", (60.0, 60.0))
    holder_side = pglock.semaphore(pool, name, 1, schema=schema)
    waiter_side = pglock.semaphore(pool, name, 1, schema=schema)  # another object: no local poke
    attempts = count_attempts(waiter_side, monkeypatch)
    results: list[bool] = []

    def waiter() -> None:
        results.append(waiter_side.acquire(timeout=30))
        waiter_side.release()

    with holder_side:
        t = threading.Thread(target=waiter)
        t.start()
        wait_until(lambda: attempts[0] == 2, 5, "the waiter's refused attempts")
        time.sleep(0.3)
        assert attempts[0] == 2  # it sleeps, it does not poll
    t.join(10)
    assert not t.is_alive() and results == [True]
    assert attempts[0] == 3

    # Negative control: permits freed behind pglock's back (no NOTIFY) do not wake it.
    holder_side.acquire()
    t = threading.Thread(target=waiter)
    t.start()
    wait_until(lambda: attempts[0] == 5, 5, "the waiter's refused attempts")
    conn.execute(sql.SQL("DELETE FROM {}.semaphore_permit WHERE semaphore = %s").format(
        sql.Identifier(schema)), (name,))
    time.sleep(0.5)
    assert attempts[0] == 5 and results == [True]
    waiter_side._poke()  # what a local release would do: it tries, and gets it
    t.join(10)
    assert results == [True, True] and attempts[0] == 6
    with pytest.raises(pglock.LockLost):
        holder_side.release()  # its row was deleted by hand

    # close() ends the LISTEN connection (nobody waits any more).
    def sessions() -> int:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                           " AND query ILIKE 'LISTEN%%'", (app_name,)).fetchone()
        return int(row[0]) if row else 0

    assert sessions() == 1
    waiter_side.close()
    wait_until(lambda: sessions() == 0, 5, "the LISTEN session to end")


def queue_length(sem: pglock.Semaphore) -> int:
    """How many threads wait in ``sem``'s own queue (the shared client's, owned by ``sem``)."""
    q = _waiting.waiters.queues.get(sem._wait_key(sem._src()), {}).get(sem)
    return len(q.tickets) if q is not None else 0


def test_local_waiters_go_in_arrival_order(pool: ConnectionPool[Any], schema: str,
                                           name: str) -> None:
    sem = pglock.semaphore(pool, name, 1, schema=schema)
    order: list[int] = []
    sem.acquire()
    threads = []
    def take(i: int) -> None:
        sem.acquire()
        order.append(i)
        sem.release()

    for i in range(4):
        t = threading.Thread(target=take, args=(i,))
        t.start()
        threads.append(t)
        queued = i + 1
        wait_until(lambda: queue_length(sem) == queued, 5, "the waiter to queue")  # noqa: B023
    sem.release()
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3]


# --- processes ---------------------------------------------------------------------------------


def _worker(dsn: str, schema: str, name: str, table: str, threads: int, rounds: int) -> None:
    """Threads taking 1 or 2 permits at random; enter/exit rows record the weight held."""
    pool: ConnectionPool[Any] = ConnectionPool(dsn, min_size=1, max_size=4,
                                               kwargs={"autocommit": True}, open=True)
    sem = pglock.semaphore(pool, name, 3, schema=schema)
    audit_lock = threading.Lock()
    audit = psycopg.connect(dsn, autocommit=True)
    tbl = sql.Identifier(table)
    go = threading.Barrier(threads)

    def record(op: str, who: str, weight: int) -> None:
        with audit_lock:
            audit.execute(sql.SQL("INSERT INTO {} (op, who, weight) VALUES (%s, %s, %s)")
                          .format(tbl), (op, who, weight))

    def run(i: int) -> None:
        rnd = random.Random(os.getpid() * 100 + i)
        go.wait(30)
        for j in range(rounds):
            weight = rnd.choice((1, 2))
            with sem.hold(permits=weight, timeout=60):
                who = f"{os.getpid()}.{i}.{j}"
                record("enter", who, weight)
                time.sleep(rnd.uniform(0.005, 0.02))
                record("exit", who, weight)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    audit.close()
    pool.close()
    print("done", flush=True)


def occupancy(rows: list[tuple[Any, ...]]) -> tuple[int, int]:
    """(peak of permits held at once, number of sections) from seq-ordered enter/exit rows."""
    cur = peak = sections = 0
    for _, op, _, weight in rows:
        if op == "enter":
            cur += weight
            sections += 1
            peak = max(peak, cur)
        else:
            cur -= weight
    assert cur == 0
    return peak, sections


def make_audit(conn: psycopg.Connection[Any]) -> str:
    table = f"sem_audit_{uuid.uuid4().hex[:10]}"
    conn.execute(sql.SQL("CREATE TABLE {} (seq bigserial PRIMARY KEY, op text NOT NULL,"
                         " who text NOT NULL, weight int NOT NULL)").format(
        sql.Identifier(table)))
    return table


def read_audit(conn: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    rows = conn.execute(sql.SQL("SELECT seq, op, who, weight FROM {} ORDER BY seq").format(
        sql.Identifier(table))).fetchall()
    conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
    return rows


def test_four_processes_eight_threads_weighted(
    dsn: str, schema: str, name: str, conn: psycopg.Connection[Any]
) -> None:
    table = make_audit(conn)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen([sys.executable, __file__, "worker", dsn, schema, name, table, "8", "3"],
                         stdout=subprocess.PIPE, cwd=ROOT, env=env, text=True)
        for _ in range(4)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert [p.returncode for p in procs] == [0] * 4, outs
    peak, sections = occupancy(read_audit(conn, table))
    assert sections == 4 * 8 * 3
    assert peak <= 3
    assert peak == 3
    assert permit_rows(conn, schema, name) == []


def test_occupancy_oracle_catches_an_overdraft(connect: Connect) -> None:
    """Negative control: two weight-2 sections inside at once (no semaphore) read as 4."""
    audit = connect()
    table = make_audit(audit)
    inside = threading.Barrier(2, timeout=10)
    mutex = threading.Lock()

    def section(i: int) -> None:
        with mutex:
            audit.execute(sql.SQL("INSERT INTO {} (op, who, weight) VALUES ('enter', %s, 2)")
                          .format(sql.Identifier(table)), (str(i),))
        inside.wait()
        with mutex:
            audit.execute(sql.SQL("INSERT INTO {} (op, who, weight) VALUES ('exit', %s, 2)")
                          .format(sql.Identifier(table)), (str(i),))

    ts = [threading.Thread(target=section, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    peak, _ = occupancy(read_audit(audit, table))
    assert peak == 4


def _holder(dsn: str, schema: str, name: str) -> None:
    sem = pglock.semaphore(dsn, name, 3, ttl=1.0, schema=schema)
    sem.acquire(permits=2)
    print("held", flush=True)
    time.sleep(120)


def test_killed_holder_gives_its_permits_back(
    dsn: str, schema: str, name: str, conn: psycopg.Connection[Any], pool: ConnectionPool[Any]
) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, __file__, "holder", dsn, schema, name],
                            stdout=subprocess.PIPE, cwd=ROOT, env=env, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        sem = pglock.semaphore(pool, name, 3, schema=schema)
        # Alive past its TTL: the keepalive renews its 2 permits.
        time.sleep(1.5)
        assert sem.count() == 2
        assert not sem.acquire(permits=2, timeout=0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # Its permits expire within its TTL, and a waiter for all 3 gets them.
        assert sem.acquire(permits=3, timeout=10)
        assert [p for _, p in permit_rows(conn, schema, name)] == [3]
        sem.release()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


if __name__ == "__main__" and len(sys.argv) > 1:
    if sys.argv[1] == "worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]),
                int(sys.argv[7]))
    elif sys.argv[1] == "holder":
        _holder(sys.argv[2], sys.argv[3], sys.argv[4])


# --- issue 11 item 5: never a permit past its client deadline ----------------------------------


def all_permit_rows(conn: psycopg.Connection[Any], schema: str, name: str) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}.semaphore_permit WHERE semaphore = %s")
                       .format(sql.Identifier(schema)), (name,)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_permit_granted_past_its_client_deadline_is_given_back(
    pool: ConnectionPool[Any], schema: str, name: str, conn: psycopg.Connection[Any],
    dsn: str, app_name: str,
) -> None:
    """A grant whose answer arrives after its client deadline (send time + ttl) is never
    believed: on main acquire() returned True with a permit already lost. A TTL shorter than
    any round trip fails a try-once acquire and leaves no permit row; an acquire that waited
    on the semaphore row for longer than its TTL gives the late permit back and goes on
    waiting, and gets a permit it can believe."""
    tiny = pglock.semaphore(pool, name, 2, ttl=1e-4, schema=schema)
    assert tiny.acquire(timeout=0) is False
    assert all_permit_rows(conn, schema, name) == 0  # granted, then given back

    sem = pglock.semaphore(pool, name, 2, ttl=0.5, schema=schema)
    result: dict[str, Any] = {}

    def take() -> None:
        with sem.hold(timeout=30) as permit:
            result["held"] = permit.locked  # at once, as the caller's body would start
            result["holder"] = permit.holder
            permit.check()
            result["rows"] = [r[0] for r in permit_rows(conn_b, schema, name)]

    with psycopg.connect(dsn) as blocker, psycopg.connect(dsn, autocommit=True) as conn_b:
        blocker.execute(sql.SQL("SELECT 1 FROM {}.semaphore WHERE name = %s FOR UPDATE")
                        .format(sql.Identifier(schema)), (name,))
        thread = threading.Thread(target=take)
        thread.start()
        wait_until(lambda: conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            " AND wait_event_type = 'Lock' AND %s = ANY(pg_blocking_pids(pid))",
            (app_name, blocker.info.backend_pid)).fetchall(), 10, "the acquire to wait")
        time.sleep(0.8)  # longer than the ttl of 0.5 s
        blocker.commit()
        thread.join(20)
    assert not thread.is_alive()
    assert result["held"] is True
    assert result["rows"] == [result["holder"]]  # the late permit was given back
    assert all_permit_rows(conn, schema, name) == 0
