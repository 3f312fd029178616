"""Singleton jobs: of several processes that start the same job at once, exactly one runs it.

Run as a script (``python test_singleton.py worker ...``) this file is one of those processes.
"""

from __future__ import annotations

import logging
import os
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

ROOT = Path(__file__).resolve().parents[2]
Connect = Callable[..., psycopg.Connection[Any]]


def _worker(dsn: str, name: str, table: str, procs: int, use_lock: bool) -> None:
    tbl = sql.Identifier(table)
    audit = psycopg.connect(dsn, autocommit=True)
    pool: ConnectionPool[Any] = ConnectionPool(
        dsn, min_size=1, max_size=2, kwargs={"autocommit": True}, open=True
    )
    locker = pglock.Locker(pool)

    def record(kind: str) -> int:
        audit.execute(sql.SQL("INSERT INTO {} (kind, who) VALUES (%s, %s)").format(tbl),
                      (kind, os.getpid()))
        row = audit.execute(sql.SQL("SELECT count(*) FROM {}").format(tbl)).fetchone()
        assert row is not None
        return int(row[0])

    def cleanup() -> str:
        # Keep running until every process has either started the job or skipped it, so
        # that every attempt overlaps this run.
        record("run")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = audit.execute(sql.SQL(
                "SELECT count(*) FROM {} WHERE kind IN ('run', 'skipped')").format(tbl)
            ).fetchone()
            if row is not None and row[0] >= procs:
                break
            time.sleep(0.02)
        return "ran"

    job = locker.singleton(name)(cleanup) if use_lock else cleanup
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    result = job()
    if result is None:
        record("skipped")
    print(result, flush=True)
    pool.close()
    audit.close()


def run_processes(dsn: str, name: str, conn: psycopg.Connection[Any], procs: int,
                  use_lock: bool) -> dict[str, int]:
    table = f"singleton_audit_{uuid.uuid4().hex[:10]}"
    tbl = sql.Identifier(table)
    conn.execute(sql.SQL("CREATE TABLE {} (seq bigserial PRIMARY KEY, kind text NOT NULL,"
                         " who int NOT NULL)").format(tbl))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", dsn, name, table, str(procs),
             "lock" if use_lock else "nolock"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env, text=True,
        )
        for _ in range(procs)
    ]
    outputs: list[str] = []
    try:
        for c in children:
            assert c.stdout is not None and c.stdout.readline().strip() == "ready"
        for c in children:  # as close to "at once" as a parent can start them
            assert c.stdin is not None
            c.stdin.write("go\n")
            c.stdin.flush()
        for c in children:
            out, _ = c.communicate(timeout=60)
            outputs.append(out.strip())
            assert c.returncode == 0
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait(10)
    counts = dict(conn.execute(sql.SQL(
        "SELECT kind, count(*) FROM {} GROUP BY kind").format(tbl)
    ).fetchall())
    conn.execute(sql.SQL("DROP TABLE {}").format(tbl))
    assert sorted(outputs) == sorted(["ran"] * counts.get("run", 0)
                                     + ["None"] * counts.get("skipped", 0))
    return counts


def test_five_processes_run_the_job_exactly_once(
    pg_dsn: str, app_name: str, name: str, conn: psycopg.Connection[Any]
) -> None:
    dsn = make_conninfo(pg_dsn, application_name=app_name)
    counts = run_processes(dsn, name, conn, 5, use_lock=True)
    assert counts == {"run": 1, "skipped": 4}


def test_negative_control_without_the_lock_every_process_runs_it(
    pg_dsn: str, app_name: str, name: str, conn: psycopg.Connection[Any]
) -> None:
    dsn = make_conninfo(pg_dsn, application_name=app_name)
    counts = run_processes(dsn, name, conn, 3, use_lock=False)
    assert counts == {"run": 3}


# --- in-process behaviour ----------------------------------------------------------------------


@pytest.fixture
def pool(pg_dsn: str, app_name: str) -> Iterator[ConnectionPool[Any]]:
    p: ConnectionPool[Any] = ConnectionPool(
        pg_dsn, min_size=1, max_size=4,
        kwargs={"application_name": app_name, "autocommit": True},
        reset=pglock.reset_connection, open=True,
    )
    try:
        yield p
    finally:
        p.close()


def test_skip_wait_and_results(
    pool: ConnectionPool[Any], connect: Connect, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[tuple[Any, ...]] = []

    @pglock.singleton(pool, name)
    def job(a: int, *, b: int = 0) -> int:
        """Doc of job."""
        calls.append((a, b))
        return a + b

    assert job.__name__ == "job" and job.__doc__ == "Doc of job."
    assert job(1, b=2) == 3
    holder = connect()
    with pglock.pg_lock(holder, name), caplog.at_level(logging.INFO, logger="pglock.singleton"):
        assert job(5) is None
        assert "skipped" in caplog.text and name in caplog.text
        waiting = pglock.singleton(pool, name, timeout=0.2)(job)
        assert waiting(7) is None
    assert calls == [(1, 2)]

    # With a timeout, the job runs once the other holder lets go.
    patient = pglock.singleton(pool, name, timeout=10)
    out: list[int | None] = []
    with pglock.pg_lock(holder, name):
        t = threading.Thread(target=lambda: out.append(patient.run(lambda: 42)))
        t.start()
        time.sleep(0.2)
        assert out == []
    t.join(10)
    assert out == [42]


def test_errors_propagate_and_release(
    pool: ConnectionPool[Any], conn: psycopg.Connection[Any], name: str
) -> None:
    @pglock.singleton(pool, name)
    def fails() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        fails()
    # The lock is free again.
    assert pglock.singleton(conn, name).run(lambda: "again") == "again"


def test_locker_namespace_and_connection_source(
    pool: ConnectionPool[Any], conn: psycopg.Connection[Any], connect: Connect, name: str
) -> None:
    locker = pglock.Locker(pool, namespace="jobs")
    seen: list[int] = []

    @locker.singleton(name)
    def job() -> None:
        seen.extend(r[0] for r in conn.execute(
            "SELECT ((classid::bigint << 32) | objid::bigint) FROM pg_locks"
            " WHERE locktype = 'advisory' AND granted").fetchall())

    job()
    assert pglock.key(f"jobs:{name}") in seen
    assert repr(locker.singleton(name)).startswith("<pglock.Singleton")
    other = connect()
    with pglock.pg_lock(other, f"jobs:{name}"):
        assert job() is None


def test_bad_arguments(pool: ConnectionPool[Any]) -> None:
    with pytest.raises(ValueError):
        pglock.singleton(pool, "")
    with pytest.raises(ValueError):
        pglock.singleton(pool, "n", timeout=-1)
    with pytest.raises(TypeError):
        pglock.singleton(pool, "n", timeout="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pglock.singleton("postgresql://x", "n")
    with pytest.raises(TypeError):
        pglock.singleton(pool, "n")(3)  # type: ignore[arg-type]


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "worker":
    _worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] == "lock")
