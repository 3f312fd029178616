"""What OpenTelemetry costs a pg_lock cycle: client CPU with telemetry off, metrics on, and
metrics with spans (pglock.configure_telemetry, docs/observability.md).

    python -m benchmarks.otel [--dsn DSN] [--cycles 3000] [--blocks 15] [--json PATH]

One uncontended ``with pglock.pg_lock(conn, name)`` cycle on one connection, in a throwaway
database. The three modes alternate in blocks (so a busy moment of the shared machine touches
each alike). Two figures per cycle, medians over blocks: the lock path's cost, this thread's
CPU time (``time.thread_time``), which scheduling noise barely touches; and the whole cost, the
process's CPU time (``time.process_time``: every thread, pglock's telemetry thread that does
the recording and the SDK's span processor thread included) until all the block queued is
recorded and exported (``pglock._telemetry.flush`` where it exists: before it pglock recorded
inline; then the span processor's ``force_flush``). "metrics" is an SDK MeterProvider
with an in-memory reader (aggregation happens when a value is recorded, as with any reader)
and a no-op tracer; "metrics+spans" adds an SDK TracerProvider with a BatchSpanProcessor (the
processor production uses) and an in-memory exporter; span_threshold 0: a span per wait.
Needs the SDK: pip install opentelemetry-sdk (the test extra has it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

import pglock

from ._common import APP_NAME, dsn_with_db, median, scratch_database

MODES = ("off", "metrics", "metrics+spans")


def _cpu_per_cycle(
    cycle: Callable[[], None], n: int, exported: Callable[[], object]
) -> tuple[float, float]:
    """(this thread's, the process's) CPU µs per cycle; the process's until ``exported()``."""
    flush = getattr(pglock._telemetry, "flush", lambda timeout: True)
    t, p = time.thread_time(), time.process_time()
    for _ in range(n):
        cycle()
    thread = time.thread_time() - t
    if not flush(60.0):
        raise RuntimeError("pglock's telemetry was not recorded within 60 s")
    exported()
    return thread * 1e6 / n, (time.process_time() - p) * 1e6 / n


def measure(dsn: str, cycles: int, blocks: int) -> dict[str, Any]:
    """Client CPU (µs) per pg_lock cycle in each mode: medians over alternating blocks."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import NoOpTracerProvider

    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(BatchSpanProcessor(exporter))
    settings: dict[str, dict[str, Any]] = {
        "off": {"enabled": False},
        "metrics": {"meter_provider": meters, "tracer_provider": NoOpTracerProvider()},
        "metrics+spans": {"meter_provider": meters, "tracer_provider": tracers},
    }
    per_block = max(1, cycles // blocks)
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    process: dict[str, list[float]] = {m: [] for m in MODES}
    with psycopg.connect(dsn, autocommit=True, application_name=APP_NAME) as conn:
        def cycle() -> None:
            with pglock.pg_lock(conn, "bench:otel"):
                pass

        try:
            for _ in range(min(200, per_block)):  # warm up: connection state, prepared statements
                cycle()
            for b in range(blocks):
                order = MODES[b % 3:] + MODES[:b % 3]  # rotate: no mode always runs first
                for mode in order:
                    pglock.configure_telemetry(**settings[mode])
                    thread, proc = _cpu_per_cycle(cycle, per_block, tracers.force_flush)
                    samples[mode].append(thread)
                    process[mode].append(proc)
                    exporter.clear()
        finally:
            pglock.configure_telemetry(enabled=False)
            tracers.shutdown()
            meters.shutdown()
        server = conn.info.parameter_status("server_version") or "?"
    off, off_process = median(samples["off"]), median(process["off"])
    queue = getattr(pglock._keepalive, "telemetry", None)  # the recordings a full queue dropped
    result: dict[str, Any] = {
        "telemetry_dropped": getattr(queue, "dropped", 0),
        "cycles_per_block": per_block,
        "blocks": blocks,
        "server_version": server,
        "modes": {},
    }
    for mode in MODES:
        med, med_process = median(samples[mode]), median(process[mode])
        result["modes"][mode] = {
            "cpu_us": round(med, 1),
            "ratio_vs_off": round(med / off, 2) if off else None,
            "min_us": round(min(samples[mode]), 1),
            "max_us": round(max(samples[mode]), 1),
            "process_cpu_us": round(med_process, 1),
            "process_ratio_vs_off": round(med_process / off_process, 2) if off_process else None,
        }
    return result


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.otel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dsn",
        default=os.environ.get("PGLOCK_BENCH_DSN")
        or os.environ.get("PGLOCK_TEST_DSN")
        or "postgresql://postgres@127.0.0.1:5432/postgres",
    )
    p.add_argument("--cycles", type=int, default=3000, help="cycles per mode (default 3000)")
    p.add_argument("--blocks", type=int, default=15, help="blocks per mode (default 15)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    with scratch_database(args.dsn, APP_NAME) as db:
        result = measure(dsn_with_db(args.dsn, db), args.cycles, args.blocks)
    result["environment"] = {
        "pglock": pglock.__version__,
        "opentelemetry_sdk": _version("opentelemetry-sdk"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    env = result["environment"]
    print(
        f"pglock {env['pglock']}, opentelemetry-sdk {env['opentelemetry_sdk']}, Python "
        f"{env['python']}, PostgreSQL {result['server_version']}, {env['cpus']} CPUs"
    )
    print(f"client CPU per pg_lock cycle, median of {args.blocks} blocks of "
          f"{result['cycles_per_block']} cycles per mode (this thread | the whole process, "
          "until recorded):")
    for mode, row in result["modes"].items():
        print(f"  {mode:<14} {row['cpu_us']:>8.1f} µs  x{row['ratio_vs_off']:.2f}  "
              f"(blocks {row['min_us']:.1f}-{row['max_us']:.1f})  | "
              f"{row['process_cpu_us']:>8.1f} µs  x{row['process_ratio_vs_off']:.2f}")
    if result["telemetry_dropped"]:
        print(f"  ({result['telemetry_dropped']} recordings dropped: the queue was full)")
    if args.json is not None:
        with contextlib.suppress(FileExistsError):
            args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
