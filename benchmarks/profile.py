"""Where pglock's time goes in an uncontended pg_lock cycle, against the raw statements.

    python -m benchmarks.profile [--dsn DSN] [--cycles 5000]

1. Client CPU per cycle (this thread's CPU time, which scheduling noise barely touches),
   pglock and raw alternating in blocks on two connections: the difference is what pglock's
   Python code costs per cycle, whatever the round trip costs on the day.
2. A pyinstrument profile of pglock cycles with real I/O: time inside psycopg is the same
   work the raw statements do; the rest is pglock's own.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence

import psycopg

import pglock

from ._adapters import sha256_key
from ._common import APP_NAME, median


def cpu_per_cycle(f: Callable[[], None], n: int) -> float:
    t = time.thread_time()
    for _ in range(n):
        f()
    return (time.thread_time() - t) * 1e6 / n


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument(
        "--dsn",
        default=os.environ.get("PGLOCK_BENCH_DSN")
        or os.environ.get("PGLOCK_TEST_DSN")
        or "postgresql://postgres@127.0.0.1:5432/postgres",
    )
    p.add_argument("--cycles", type=int, default=5000)
    p.add_argument("--blocks", type=int, default=20)
    args = p.parse_args(argv)

    name = "bench:profile:pg_lock"
    k = sha256_key(name)
    with (
        psycopg.connect(args.dsn, autocommit=True, application_name=APP_NAME) as c1,
        psycopg.connect(args.dsn, autocommit=True, application_name=APP_NAME) as c2,
    ):

        def raw() -> None:
            c1.execute("SELECT pg_advisory_lock(%s)", (k,))
            c1.execute("SELECT pg_advisory_unlock(%s)", (k,))

        def pg() -> None:
            with pglock.pg_lock(c2, name):
                pass

        for f in (raw, pg):
            for _ in range(50):
                f()
        per = max(1, args.cycles // args.blocks)
        cpu: dict[str, list[float]] = {"raw": [], "pglock": []}
        for b in range(args.blocks):
            order = [("raw", raw), ("pglock", pg)]
            for key, f in order if b % 2 == 0 else order[::-1]:
                cpu[key].append(cpu_per_cycle(f, per))
        r, g = median(cpu["raw"]), median(cpu["pglock"])
        print(
            f"client CPU per cycle (median of {args.blocks} blocks of {per}): raw {r:.1f} µs, "
            f"pglock {g:.1f} µs: pglock adds {g - r:.1f} µs of Python per cycle ({g / r:.2f}x)"
        )

        from pyinstrument import Profiler

        prof = Profiler(interval=0.0001)
        prof.start()
        for _ in range(args.cycles):
            pg()
        prof.stop()
        print(prof.output_text(unicode=False, color=False, show_all=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
