"""The benchmark harness must keep working: run it with tiny counts and check what it writes.

These tests check that the harness runs, cleans up after itself and writes valid results; they
never look at speed (the machine is shared and noisy). The lost-update oracle of workload D is
checked both ways: exact under a real lock, and reporting the lost update when two unlocked
writers are forced to interleave (negative control).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pglock

# The harness compares pglock with peer libraries from the ``bench`` extra (CI installs it).
# With only the ``test`` extra (the README's quick start) there is nothing to compare against.
# Under CI a missing peer is an error, never a skip.
for _peer in ("pals", "postgresql_lock", "redis", "redis_lock", "pottery", "matplotlib"):
    if os.environ.get("CI"):
        importlib.import_module(_peer)
    else:
        pytest.importorskip(_peer, reason="the benchmark peers need: pip install -e '.[bench]'")

ROOT = Path(__file__).resolve().parents[1]
STATUSES = {"met", "not met", "not yet measurable"}


def _sessions(dsn: str, app_name: str) -> int:
    with psycopg.connect(dsn, autocommit=True, application_name="pglock-checker") as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app_name,)
        ).fetchone()
        return int(row[0]) if row else 0


def _check_lease_workloads(w: dict[str, Any]) -> None:
    if "skipped" not in w["F"]:  # every waiter got the lease, in one process and across
        for part in ("one_process", "processes"):
            assert not w["F"][part].get("errors"), w["F"][part]
            assert w["F"][part]["handoffs"] == w["F"][part]["waiters"] > 0, w["F"][part]
        across = w["F"]["processes"]  # one grant (token) per waiter: the order is a permutation
        assert sorted(across["grant_order"]) == list(range(across["waiters"])), across
        assert (across["grants_in_arrival_order"] is None) == (across["arrival_check"] is None)
    if "skipped" not in w["H"]:  # the WAL-flush count tells the controls apart: 0 and 2
        h = w["H"]["contenders"]
        assert not any(r.get("errors") for r in h.values()), h
        assert h["raw"]["flushes_per_cycle"] <= 0.1, h
        assert abs(h["ttl-table"]["flushes_per_cycle"] - 2) <= 0.1, h


@pytest.mark.timeout(90)
def test_quick_run_writes_results(pg_dsn: str, app_name: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--quick",
            "--dsn",
            pg_dsn,
            "--out",
            str(tmp_path),
            "--application-name",
            app_name,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pglock " + pglock.__version__ in proc.stdout.splitlines()[0]  # environment line

    files = sorted(tmp_path.glob("*-quick.json"))
    assert len(files) == 1, list(tmp_path.iterdir())
    result: dict[str, Any] = json.loads(files[0].read_text())
    assert result["quick"] is True
    assert result["environment"]["pglock"] == pglock.__version__
    assert result["environment"]["psycopg_impl"] == psycopg.pq.__impl__
    assert set(result["workloads"]) == set("ABCDEFGH")

    w = result["workloads"]
    for key in ("raw", "pglock", "pglock-10", "pglock-xact", "postgresql-lock", "pals"):
        entry = w["A"]["adapters"][key]
        assert "error" not in entry, (key, entry)
        assert entry["p50_us"] > 0 and entry["cycles"] > 0
    assert w["A"]["adapters"]["raw"]["ratio"] == 1.0
    assert w["A"]["pinned"] is None and w["G"].get("pinned") is None  # --pin-cpu not given
    assert w["A"]["adapters"]["raw"]["round_trips"] == 2.0
    assert w["A"]["xact"]["raw_lock_round_trips"] == 1
    for tag in "BD":
        for key, entry in w[tag]["adapters"].items():
            assert not entry.get("errors"), (tag, key, entry)
            assert entry["cycles_per_s"] > 0, (tag, key)
    for key, entry in w["D"]["adapters"].items():
        assert entry["exact"] is True and entry["lost_updates"] == 0, (key, entry)
    for key, entry in w["C"]["adapters"].items():
        assert not entry.get("errors"), (key, entry)
        assert entry["handoffs"] > 0 and entry["p50_ms"] > 0, key
    for tag in "EFGH":
        assert "skipped" in w[tag] or "errors" not in w[tag], (tag, w[tag])
    _check_lease_workloads(w)
    if "skipped" not in w["E"]:
        assert w["E"]["keepalive"]["leases_lost"] == 0, w["E"]
        assert w["E"]["acquire_vs_rows"]["samples"] > 0, w["E"]

    assert {t["status"] for t in result["targets"]} <= STATUSES
    assert {t["status"] for t in result["targets_13"]} <= STATUSES
    assert {t["id"] for t in result["targets_13"]} >= {"A:floor", "A:peer", "F:fifo", "lease:wal"}
    assert {t["id"] for t in result["targets"]} >= {"pg_lock", "multi_key", "pool_lock"}
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra (CI has it)
        assert (tmp_path / "chart-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no chart: matplotlib is not installed" in proc.stdout
    assert (tmp_path / f"{files[0].stem}.md").read_text().startswith("Run ")

    # The harness cleans up: its scratch database is gone and its sessions have ended.
    with psycopg.connect(pg_dsn, autocommit=True, application_name=app_name) as c:
        gone = c.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", (result["scratch_database"],)
        ).fetchone()
    assert gone == (0,)
    deadline = time.monotonic() + 10
    while _sessions(pg_dsn, app_name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sessions(pg_dsn, app_name) == 0


@pytest.fixture
def bench_ctx(pg_dsn: str, app_name: str) -> Any:
    from benchmarks._common import Context, Settings, dsn_with_db, scratch_database

    with scratch_database(pg_dsn, app_name) as db:
        yield Context(
            dsn=pg_dsn,
            scratch_dsn=dsn_with_db(pg_dsn, db),
            scratch_db=db,
            redis_url=None,
            app_name=app_name,
            settings=Settings.quick_(),
        )


def test_lost_update_check_has_teeth(bench_ctx: Any) -> None:
    from benchmarks._adapters import NoLock, Pglock
    from benchmarks._workloads import contend

    # Negative control: no lock, and both threads read before either writes.
    barrier = threading.Barrier(2, timeout=20)

    def both_have_read() -> None:
        barrier.wait()

    bad = contend(
        bench_ctx,
        NoLock(),
        threads=2,
        seconds=30,
        same_name=True,
        counter=True,
        between=both_have_read,
        max_cycles=1,
    )
    assert bad["cycles"] == 2 and bad["counter"] == 1
    assert bad["lost_updates"] == 1 and bad["exact"] is False

    good = contend(
        bench_ctx, Pglock(), threads=3, seconds=30, same_name=True, counter=True, max_cycles=20
    )
    assert not good.get("errors"), good
    assert good["cycles"] == 60 and good["counter"] == 60 and good["exact"] is True


def test_counters_count_round_trips(bench_ctx: Any) -> None:
    from benchmarks._common import StatementCounter, trace_round_trips

    with bench_ctx.connect() as conn:
        with StatementCounter() as counter:
            conn.execute("SELECT 1")
            with conn.transaction():  # BEGIN and COMMIT are round trips too
                conn.execute("SELECT 1; SELECT 2")  # one batch, one round trip
            # What pglock's cancellable statements do: drive the cursor's generator directly.
            cur = conn.cursor()
            conn.wait(cur._execute_gen("SELECT 1", None))
        assert counter.total == 5
        assert sum(counter.snapshot().values()) == 5 and len(counter.stamps()) == 5
        conn.execute("SELECT 1")  # not counted once the counter is closed
        assert counter.total == 5

        with trace_round_trips([conn]) as count:
            conn.execute("SELECT 1")
            with conn.transaction():
                conn.execute("SELECT 1")
        assert count() == 4


def _may_pin(pid: int) -> bool:
    """Whether ``pid`` is a postgres process on this machine whose affinity we may set."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"postgres" not in f.read():
                return False
        os.sched_setaffinity(pid, os.sched_getaffinity(pid))  # a no-op, if allowed
    except OSError:
        return False
    return True


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_cpu_pins_the_runs_backends_and_puts_everything_back(bench_ctx: Any) -> None:
    from benchmarks._common import pinned

    with pinned(bench_ctx) as pin:  # not asked for: nothing happens
        assert pin is None
    before = os.sched_getaffinity(0)
    cpu = max(before)
    with bench_ctx.connect() as a, bench_ctx.connect() as b:
        pids = [a.info.backend_pid, b.info.backend_pid]
        may = all(_may_pin(pid) for pid in pids)
        theirs = {pid: os.sched_getaffinity(pid) for pid in pids} if may else {}
        bench_ctx.pin_cpu = cpu
        with pinned(bench_ctx) as pin:
            if may:
                assert pin == {"cpu": cpu, "pinned": True, "backends": 2}
                assert os.sched_getaffinity(0) == {cpu}
                assert all(os.sched_getaffinity(pid) == {cpu} for pid in pids)
            else:  # a server elsewhere, or not ours to pin: nothing is, and the run says so
                assert pin is not None and pin["pinned"] is False, pin
                assert os.sched_getaffinity(0) == before
                assert any("--pin-cpu" in n for n in bench_ctx.notes), bench_ctx.notes
            # Both sessions still work on their pinned backends.
            assert a.execute("SELECT 1").fetchone() == b.execute("SELECT 1").fetchone() == (1,)
        assert os.sched_getaffinity(0) == before
        assert {pid: os.sched_getaffinity(pid) for pid in theirs} == theirs


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_cpu_refuses_a_cpu_this_process_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.run import parse_args

    allowed = os.sched_getaffinity(0)
    assert parse_args(["--pin-cpu", str(min(allowed))]).pin_cpu == min(allowed)
    for bad in (-1, max(allowed) + 1):
        with pytest.raises(SystemExit) as ei:  # before any connection is made
            parse_args(["--pin-cpu", str(bad)])
        assert ei.value.code == 2
        assert f"--pin-cpu {bad}: this process may run on CPUs" in capsys.readouterr().err


def test_issue13_targets_come_from_the_figures() -> None:
    from benchmarks import _targets

    # Nothing measured: nothing is met by default.
    assert {t["status"] for t in _targets.evaluate({}, None)} == {"not yet measurable"}

    def a_with(pglock: float, direct: float) -> dict[str, Any]:
        adapters = {
            "raw": {"ratio": 1.0, "cpu_us": 50.0},
            "postgresql-lock": {"ratio": 1.05, "cpu_diff_us": 4.0},
            "pglock": {
                "ratio": pglock,
                "cpu_diff_us": 8.0,
                "vs": {"postgresql-lock": {"ratio": direct}},
            },
        }
        got = {t["id"]: t["status"] for t in _targets.evaluate({"A": {"adapters": adapters}}, None)}
        return got

    met = a_with(1.02, 0.98)
    assert (met["A:floor"], met["A:peer"], met["A:cpu"]) == ("met", "met", "met")
    slow = a_with(1.2, 1.15)
    assert (slow["A:floor"], slow["A:peer"]) == ("not met", "not met")
    # Through the floor pglock looks faster than the peer, paired directly it is not: not met.
    assert a_with(1.02, 1.1)["A:peer"] == "not met"

    def wal(lease: float, raw: float, ttl: float) -> str:
        h = {
            "H": {
                "contenders": {
                    k: {"flushes_per_cycle": v}
                    for k, v in (("lease", lease), ("raw", raw), ("ttl-table", ttl))
                }
            }
        }
        (row,) = [t for t in _targets.evaluate(h, None) if t["id"] == "lease:wal"]
        return str(row["status"])

    assert wal(1.002, 0.0, 2.0) == "met"
    assert wal(2.0, 0.0, 2.0) == "not met"
    assert wal(1.0, 0.0, 1.0) == "not yet measurable"  # the controls are off: not trusted


@pytest.mark.timeout(90)
def test_otel_benchmark_runs(pg_dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "otel.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.otel", "--dsn", pg_dsn, "--cycles", "30",
         "--blocks", "3", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=80, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("pglock " + pglock.__version__)  # environment line
    result: dict[str, Any] = json.loads(out.read_text())
    assert set(result["modes"]) == {"off", "metrics", "metrics+spans"}
    assert all(row["cpu_us"] > 0 for row in result["modes"].values())
    assert result["modes"]["off"]["ratio_vs_off"] == 1.0
