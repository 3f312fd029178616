"""Read-write locks: readers share, a writer excludes everyone, and a waiting writer is not
overtaken by readers that arrive after it (Postgres's lock queue)."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import sa_url
from _threads import in_thread, started
from psycopg import sql
from psycopg_pool import ConnectionPool

import pglock

Connect = Callable[..., psycopg.Connection[Any]]


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def lock_rows(conn: psycopg.Connection[Any], name: str) -> list[tuple[int, str, bool]]:
    """(pid, mode, granted) of every advisory lock request on ``name``, by pid."""
    k = pglock.key(name)
    return conn.execute(
        "SELECT pid, mode, granted FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"
        " AND ((classid::bigint << 32) | objid::bigint) = %s ORDER BY pid",
        (k,),
    ).fetchall()


def request_of(conn: psycopg.Connection[Any], name: str, pid: int) -> tuple[str, bool] | None:
    for p, mode, granted in lock_rows(conn, name):
        if p == pid:
            return mode, granted
    return None


@pytest.fixture
def pool(pg_dsn: str, app_name: str) -> Iterator[ConnectionPool[Any]]:
    p: ConnectionPool[Any] = ConnectionPool(
        pg_dsn,
        min_size=2,
        max_size=12,
        kwargs={"application_name": app_name, "autocommit": True},
        reset=pglock.reset_connection,
        open=True,
    )
    try:
        yield p
    finally:
        p.close()


# --- the overlap audit ---------------------------------------------------------------------


class Audit:
    """Enter/exit rows numbered by one sequence, written on a separate connection while the
    lock is held: two intervals overlap iff one entered before the other exited."""

    def __init__(self, connect: Connect) -> None:
        self.table = f"rw_audit_{uuid.uuid4().hex[:10]}"
        self._conn = connect()
        self._mutex = threading.Lock()
        self._conn.execute(
            sql.SQL(
                "CREATE TABLE {} (seq bigserial PRIMARY KEY, op text NOT NULL,"
                " kind text NOT NULL, who text NOT NULL)"
            ).format(sql.Identifier(self.table))
        )

    def record(self, op: str, kind: str, who: str) -> None:
        with self._mutex:
            self._conn.execute(
                sql.SQL("INSERT INTO {} (op, kind, who) VALUES (%s, %s, %s)").format(
                    sql.Identifier(self.table)
                ),
                (op, kind, who),
            )

    def intervals(self) -> list[tuple[str, int, int]]:
        rows = self._conn.execute(
            sql.SQL("SELECT seq, op, kind, who FROM {} ORDER BY seq").format(
                sql.Identifier(self.table)
            )
        ).fetchall()
        open_: dict[str, tuple[str, int]] = {}
        out: list[tuple[str, int, int]] = []
        for seq, op, kind, who in rows:
            if op == "enter":
                open_[who] = (kind, seq)
            else:
                k, start = open_.pop(who)
                out.append((k, start, seq))
        assert not open_, open_
        return out

    def drop(self) -> None:
        self._conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(self.table)))


def overlaps(intervals: list[tuple[str, int, int]]) -> tuple[list[tuple[Any, ...]], int]:
    """(pairs where a writer overlaps anyone, the peak number of concurrent readers)."""
    bad = []
    for i, (ka, sa, ea) in enumerate(intervals):
        for kb, sb, eb in intervals[i + 1 :]:
            if sa < eb and sb < ea and "write" in (ka, kb):
                bad.append(((ka, sa, ea), (kb, sb, eb)))
    events = sorted(
        [(s, 1) for k, s, _ in intervals if k == "read"]
        + [(e, -1) for k, _, e in intervals if k == "read"]
    )
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return bad, peak


@pytest.fixture
def audit(connect: Connect) -> Iterator[Audit]:
    a = Audit(connect)
    try:
        yield a
    finally:
        a.drop()


def run_workers(n: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "worker did not finish"
    if errors:
        raise errors[0]


def test_readers_overlap_and_writers_exclude_everyone(
    pool: ConnectionPool[Any], audit: Audit, name: str
) -> None:
    rw = pglock.rwlock(pool, name)
    # Three readers inside at once: a barrier that only read-sharing can pass.
    inside = threading.Barrier(3, timeout=10)

    def reader(i: int) -> None:
        with rw.read(timeout=10):
            audit.record("enter", "read", f"r{i}")
            inside.wait()
            audit.record("exit", "read", f"r{i}")

    run_workers(3, reader)

    # Then a mixed workload: 8 workers, about a quarter of the sections are writes.
    def worker(i: int) -> None:
        rnd = random.Random(i)
        for j in range(12):
            kind = "write" if rnd.random() < 0.25 else "read"
            with rw.write() if kind == "write" else rw.read():
                audit.record("enter", kind, f"w{i}.{j}")
                time.sleep(rnd.uniform(0, 0.004))
                audit.record("exit", kind, f"w{i}.{j}")

    run_workers(8, worker)
    intervals = audit.intervals()
    bad, peak = overlaps(intervals)
    assert len(intervals) == 3 + 8 * 12
    assert sum(k == "write" for k, _, _ in intervals) > 0
    assert peak > 1
    assert bad == []


def test_overlap_oracle_catches_a_writer_that_shares(
    pool: ConnectionPool[Any], audit: Audit, name: str
) -> None:
    """Negative control: a 'writer' that takes the shared lock is caught by the audit."""
    rw = pglock.rwlock(pool, name)
    inside = threading.Barrier(2, timeout=10)

    def worker(i: int) -> None:
        kind = "write" if i == 0 else "read"
        with rw.read(timeout=10):  # the broken writer reads
            audit.record("enter", kind, f"x{i}")
            inside.wait()
            audit.record("exit", kind, f"x{i}")

    run_workers(2, worker)
    bad, _ = overlaps(audit.intervals())
    assert len(bad) == 1


def test_threads_sharing_one_connection(conn: psycopg.Connection[Any], audit: Audit,
                                        name: str) -> None:
    """On one connection pglock arbitrates between threads: readers share, writers don't."""
    rw = pglock.rwlock(conn, name)

    def worker(i: int) -> None:
        rnd = random.Random(100 + i)
        for j in range(10):
            kind = "write" if rnd.random() < 0.3 else "read"
            with rw.write() if kind == "write" else rw.read():
                audit.record("enter", kind, f"t{i}.{j}")
                time.sleep(rnd.uniform(0, 0.003))
                audit.record("exit", kind, f"t{i}.{j}")

    run_workers(5, worker)
    bad, _ = overlaps(audit.intervals())
    assert bad == []
    assert lock_rows(conn, name) == []


# --- the writer queue ------------------------------------------------------------------------


def test_reader_arriving_after_a_waiting_writer_queues_behind_it(
    connect: Connect, name: str
) -> None:
    r1, w, r2, observer = connect(), connect(), connect(), connect()
    pid_w, pid_r2 = w.info.backend_pid, r2.info.backend_pid
    granted_order: list[str] = []
    release_w = threading.Event()

    def writer() -> None:
        with pglock.rwlock(w, name).write():
            granted_order.append("writer")
            release_w.wait(10)

    def late_reader() -> None:
        with pglock.rwlock(r2, name).read():
            granted_order.append("reader2")

    with pglock.rwlock(r1, name).read():
        tw = threading.Thread(target=writer)
        tw.start()
        wait_until(lambda: request_of(observer, name, pid_w) == ("ExclusiveLock", False),
                   what="the writer to wait")
        # A try-read now fails although only readers hold the lock: the writer is queued.
        with pytest.raises(pglock.LockNotAcquired), pglock.rwlock(observer, name).read(0):
            pass
        tr = threading.Thread(target=late_reader)
        tr.start()
        wait_until(lambda: request_of(observer, name, pid_r2) == ("ShareLock", False),
                   what="the late reader to queue")
        # Still waiting a moment later: it is not granted next to the first reader.
        time.sleep(0.2)
        assert request_of(observer, name, pid_r2) == ("ShareLock", False)
        assert granted_order == []
    # The first reader left: the writer goes first, the late reader still waits.
    wait_until(lambda: granted_order == ["writer"], what="the writer to be granted")
    assert request_of(observer, name, pid_w) == ("ExclusiveLock", True)
    assert request_of(observer, name, pid_r2) == ("ShareLock", False)
    release_w.set()
    tw.join(10)
    tr.join(10)
    assert granted_order == ["writer", "reader2"]
    assert lock_rows(observer, name) == []


# --- timeouts, nesting, namespaces, inputs -----------------------------------------------------


def test_write_timeout_and_try(connect: Connect, name: str) -> None:
    a, b = connect(), connect()
    with pglock.rwlock(a, name).read():
        rw = pglock.rwlock(b, name)
        with pytest.raises(pglock.LockNotAcquired) as info, rw.write(timeout=0.2):
            pass
        assert info.value.name == name
        with pytest.raises(pglock.LockNotAcquired), rw.write(timeout=0):
            pass
        with rw.read(timeout=0) as got:  # readers still share
            assert got is b
    assert lock_rows(a, name) == []


def test_nesting(conn: psycopg.Connection[Any], pool: ConnectionPool[Any], name: str) -> None:
    rw = pglock.rwlock(conn, name)
    with rw.write(), rw.read():  # re-entry on one connection is counted
        assert [m for _, m, _ in lock_rows(conn, name)] == ["ExclusiveLock"]
    with rw.read(), pytest.raises(pglock.LockError, match="upgrad"), rw.write():
        pass
    pooled = pglock.rwlock(pool, name)
    with pooled.read(), pytest.raises(pglock.SelfDeadlock, match="wait for itself"), pooled.read():
        pass
    with pooled.write():  # not nested any more
        pass
    assert lock_rows(conn, name) == []


def test_pooled_read_lock_not_reentrant_shared_with_others_excludes_writers(
    pool: ConnectionPool[Any], connect: Connect, name: str
) -> None:
    """kazoo ``test_read_lock`` and ``test_write_lock`` through a pool, non-blocking: a second
    read or a write by the same thread answers False (it holds the name through another
    connection); another thread shares the read lock and cannot write; the writer excludes."""
    rw, observer = pglock.rwlock(pool, name), connect()
    read = rw.read()
    assert read.acquire(blocking=False) is True and read.locked
    assert rw.read().acquire(blocking=False) is False  # still not re-entrant
    assert rw.write().acquire(blocking=False) is False  # nor an upgrade
    assert rw.write(timeout=0.5).acquire() is False  # a timed one answers at once too
    entered, leave = threading.Event(), threading.Event()

    def second_reader() -> bool:
        with rw.read(timeout=0):
            entered.set()
            return leave.wait(20)

    second = started(second_reader)
    assert entered.wait(20)
    assert sorted(m for _, m, _ in lock_rows(observer, name)) == ["ShareLock", "ShareLock"]
    assert in_thread(lambda: rw.write().acquire(blocking=False)) is False
    leave.set()
    assert second() is True
    read.release()
    write = rw.write()
    assert write.acquire(blocking=False) is True
    assert rw.read().acquire(blocking=False) is False
    assert in_thread(lambda: rw.read().acquire(blocking=False)) is False
    assert [m for _, m, _ in lock_rows(observer, name)] == ["ExclusiveLock"]
    write.release()
    assert lock_rows(observer, name) == []


def test_locker_namespace_and_engine(pg_dsn: str, app_name: str, connect: Connect) -> None:
    sa = pytest.importorskip("sqlalchemy")
    url = sa_url(pg_dsn)
    engine = sa.create_engine(url, connect_args={"application_name": app_name})
    observer = connect()
    try:
        locker = pglock.Locker(engine, namespace="rwtest")
        short = f"cfg-{uuid.uuid4().hex[:8]}"
        rw = locker.rwlock(short)
        assert rw.name == f"rwtest:{short}"
        with rw.write() as c:
            assert isinstance(c, sa.engine.Connection)
            rows = lock_rows(observer, f"rwtest:{short}")
            assert [(m, g) for _, m, g in rows] == [("ExclusiveLock", True)]
        with pglock.rwlock(engine, short).read():
            assert [m for _, m, _ in lock_rows(observer, short)] == ["ShareLock"]
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("source", "name", "exc"),
    [
        ("postgresql://x", "n", TypeError),
        (object(), "n", TypeError),
        (None, "n", TypeError),
    ],
)
def test_bad_sources(source: object, name: str, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        pglock.rwlock(source, name)


def test_bad_names_and_timeouts(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(ValueError):
        pglock.rwlock(conn, "")
    with pytest.raises(TypeError):
        pglock.rwlock(conn, 3)  # type: ignore[arg-type]
    rw = pglock.rwlock(conn, "ok")
    with pytest.raises(ValueError):
        rw.read(timeout=-1)
    with pytest.raises(TypeError):
        rw.write(timeout="1")  # type: ignore[arg-type]
