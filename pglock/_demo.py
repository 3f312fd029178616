"""``pglock demo``: worker processes race for a batch of jobs (check whether done, work, mark
done), guarded by ``pg_lock(conn, "demo:job:<id>", timeout=0)`` and then not; see
docs/reference/cli.md. Without a DSN it runs on an embedded ``pgserver``."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import psycopg

from ._advisory import pg_lock

_SCHEMA_SQL = """
DROP SCHEMA IF EXISTS pglock_demo CASCADE;
CREATE SCHEMA pglock_demo;
CREATE TABLE pglock_demo.jobs (id int PRIMARY KEY, done boolean NOT NULL DEFAULT false);
CREATE TABLE pglock_demo.runs (job_id int NOT NULL, worker int NOT NULL, phase text NOT NULL);
"""


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, application_name="pglock-demo")


def _done_and_runs(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    row = conn.execute("SELECT count(DISTINCT job_id), count(*) FROM pglock_demo.runs").fetchone()
    return row or (0, 0)


@dataclass
class PhaseResult:
    phase: str
    jobs: int
    runs: int
    duplicates: int
    seconds: float


@dataclass
class DemoResult:
    with_lock: PhaseResult
    without_lock: PhaseResult
    handoff_p50_ms: float


@contextlib.contextmanager
def embedded_server() -> Iterator[str]:
    """Start a throwaway Postgres from the ``pgserver`` package; yield its DSN."""
    with warnings.catch_warnings():
        # pgserver's platformdirs warns when XDG_RUNTIME_DIR is unset (CI); its fallback is fine.
        warnings.simplefilter("ignore")
        try:
            import pgserver
        except ImportError:
            raise RuntimeError(
                "the demo needs a Postgres server: pass --dsn, or install the embedded server "
                "with pip install 'pglock[embedded]'"
            ) from None
        tmp = tempfile.mkdtemp(prefix="pglock-demo-")
        server = pgserver.get_server(tmp, cleanup_mode="stop")  # type: ignore[attr-defined]
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def _worker(dsn: str, worker: int, jobs: int, use_lock: bool, phase: str) -> None:
    rnd = random.Random(worker)
    with _connect(dsn) as conn:
        for job in range(jobs):
            if use_lock:
                lock = pg_lock(conn, f"demo:job:{job}", timeout=0)
                if not lock.acquire():
                    continue  # another worker has it: move on
            try:
                done = conn.execute("SELECT done FROM pglock_demo.jobs WHERE id = %s", (job,))
                row = done.fetchone()
                if row is None or row[0]:
                    continue
                time.sleep(rnd.uniform(0.001, 0.004))  # the "work"
                conn.execute(
                    "INSERT INTO pglock_demo.runs (job_id, worker, phase) VALUES (%s, %s, %s)",
                    (job, worker, phase),
                )
                conn.execute("UPDATE pglock_demo.jobs SET done = true WHERE id = %s", (job,))
            finally:
                if use_lock:
                    lock.release()


def _bar(done: int, total: int, dup: int, width: int = 30) -> str:
    filled = int(width * done / total) if total else width
    bar = "#" * filled + "." * (width - filled)
    return f"[{bar}] {done:4d}/{total} jobs done, duplicates: {dup}"


def _run_phase(
    dsn: str, phase: str, use_lock: bool, workers: int, jobs: int, out: TextIO
) -> PhaseResult:
    with _connect(dsn) as conn:
        conn.execute("TRUNCATE pglock_demo.jobs, pglock_demo.runs")
        conn.execute(
            "INSERT INTO pglock_demo.jobs (id) SELECT g FROM generate_series(0, %s) g", (jobs - 1,)
        )
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(dsn, w, jobs, use_lock, phase), daemon=True)
            for w in range(workers)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()
        tty = out.isatty()
        next_mark = 0  # without a terminal, print a line at every quarter instead of redrawing
        printed = ""
        while True:
            alive = any(p.is_alive() for p in procs)
            done, runs = _done_and_runs(conn)
            line = _bar(done, jobs, runs - done)
            if tty:
                out.write("\r  " + line)
            elif (done >= next_mark or not alive) and line != printed:
                out.write("  " + line + "\n")
                printed = line
                while next_mark <= done:
                    next_mark += max(1, jobs // 4)
            out.flush()
            if not alive:
                break
            if time.monotonic() - start > 120:
                raise RuntimeError("demo workers did not finish within 120 s")
            time.sleep(0.1)
        if tty:
            out.write("\n")
        elapsed = time.monotonic() - start
        for p in procs:
            p.join(timeout=5)
            if p.exitcode != 0:
                raise RuntimeError(f"a demo worker failed (exit code {p.exitcode})")
        done, runs = _done_and_runs(conn)
    return PhaseResult(phase, done, runs, runs - done, elapsed)


def _handoff_ms(dsn: str, rounds: int = 20) -> float:
    """Median time from release by one session to acquisition by a blocked one, in ms."""
    samples: list[float] = []
    with _connect(dsn) as holder, _connect(dsn) as waiter:
        for i in range(rounds):
            name = f"demo:handoff:{i}"
            got_at: list[float] = []
            lock = pg_lock(holder, name)
            lock.acquire()

            def wait(name: str = name, got_at: list[float] = got_at) -> None:
                with pg_lock(waiter, name):
                    got_at.append(time.perf_counter())

            t = threading.Thread(target=wait)
            t.start()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # until the waiter is queued in Postgres
                row = holder.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                    "AND pid = %s", (waiter.info.backend_pid,),
                ).fetchone()
                if row and row[0]:
                    break
                time.sleep(0.002)
            released_at = time.perf_counter()
            lock.release()
            t.join(timeout=5)
            if got_at:
                samples.append((got_at[0] - released_at) * 1000)
    return statistics.median(samples) if samples else float("nan")


def run_demo(
    dsn: str | None = None, *, workers: int = 4, jobs: int = 200, out: TextIO | None = None
) -> DemoResult:
    """Run the demo and print its progress and summary to ``out`` (stdout by default)."""
    out = out or sys.stdout
    with contextlib.ExitStack() as stack:
        if dsn is None:
            out.write("Starting an embedded Postgres (pgserver) in a temporary directory...\n")
            dsn = stack.enter_context(embedded_server())
        with _connect(dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            conn.execute(_SCHEMA_SQL)
        out.write(f"Postgres {version[0] if version else '?'}; {workers} worker processes, "
                  f"{jobs} jobs, each worker walks every job.\n\n")
        try:
            out.write(
                "1) With pglock: each job guarded by pg_lock(conn, 'demo:job:<id>', timeout=0)\n"
            )
            locked = _run_phase(dsn, "with-pglock", True, workers, jobs, out)
            out.write("2) Without locks: the same check-then-act race, unguarded\n")
            unlocked = _run_phase(dsn, "without-lock", False, workers, jobs, out)
            handoff = _handoff_ms(dsn)
        finally:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("DROP SCHEMA IF EXISTS pglock_demo CASCADE")
        out.write("\nSummary\n")
        for label, r in (("with pglock:  ", locked), ("without locks:", unlocked)):
            out.write(f"  {label} {r.jobs} jobs done, {r.runs} runs, "
                      f"duplicates: {r.duplicates}  ({r.seconds:.1f} s)\n")
        out.write(f"  handoff latency (release -> blocked waiter acquires, p50): "
                  f"{handoff:.2f} ms\n")
        if locked.duplicates == 0 and unlocked.duplicates > 0:
            out.write("pglock kept every job to exactly one run; without it, jobs ran twice.\n")
        elif locked.duplicates:
            out.write("UNEXPECTED: duplicates with pglock. Please report this.\n")
        else:
            out.write("(This run happened to show no duplicates without locks; run it again.)\n")
        return DemoResult(locked, unlocked, handoff)


if __name__ == "__main__":  # pragma: no cover
    run_demo(os.environ.get("PGLOCK_DSN"))
