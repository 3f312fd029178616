"""What the name registry costs under B's load: 8 threads, each taking its own names in turn
with ``pg_lock(conn, name, timeout=0)``, on a database with pglock's schema (and so the
registry) against one without, in alternating repetitions.

    python -m benchmarks.registry [--dsn DSN] [--reps 6] [--seconds 1.5] [--names 100]

Every repetition uses names no process has met, so each one's first use is in the measurement
(the registry's worst case: a name per job id). Prints cycles/s for both databases and the
median of the per-repetition ratios (with / without).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack

import psycopg

import pglock

from ._common import APP_NAME, dsn_with_db, median, scratch_database
from ._leases import install_schema


def cycles_per_s(dsn: str, threads: int, names: int, seconds: float) -> float:
    """B's load on ``dsn``, each thread over ``names`` fresh names: total cycles/s."""
    run = uuid.uuid4().hex[:8]
    counts = [0] * threads
    stop = threading.Event()
    with ExitStack() as stack:
        conns = [
            stack.enter_context(psycopg.connect(dsn, autocommit=True, application_name=APP_NAME))
            for _ in range(threads)
        ]
        ready = threading.Barrier(threads + 1)

        def worker(i: int) -> None:
            mine = [f"bench:registry:{run}:{i}:{j}" for j in range(names)]
            ready.wait()
            n = 0
            while not stop.is_set():
                with pglock.pg_lock(conns[i], mine[n % names], timeout=0):
                    pass
                n += 1
            counts[i] = n

        ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
        for t in ts:
            t.start()
        ready.wait()
        started = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        for t in ts:
            t.join(30)
        return sum(counts) / (time.perf_counter() - started)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.registry", description=__doc__)
    p.add_argument("--dsn", default=os.environ.get("PGLOCK_BENCH_DSN")
                   or os.environ.get("PGLOCK_TEST_DSN")
                   or "postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--names", type=int, default=100)
    p.add_argument("--threads", type=int, default=8)
    args = p.parse_args(argv)
    with ExitStack() as stack:
        with_db = stack.enter_context(scratch_database(args.dsn, APP_NAME, "pglock_bench_reg"))
        bare_db = stack.enter_context(scratch_database(args.dsn, APP_NAME, "pglock_bench_bare"))
        with_dsn, bare_dsn = dsn_with_db(args.dsn, with_db), dsn_with_db(args.dsn, bare_db)
        err = install_schema(with_dsn)
        if err:
            raise SystemExit(err)
        rates: dict[str, list[float]] = {"with": [], "without": []}
        for rep in range(args.reps):
            order = [("with", with_dsn), ("without", bare_dsn)]
            for key, dsn in order if rep % 2 == 0 else order[::-1]:
                rates[key].append(cycles_per_s(dsn, args.threads, args.names, args.seconds))
        with psycopg.connect(with_dsn, autocommit=True) as c:
            row = c.execute("SELECT count(*) FROM pglock.lock_names").fetchone()
        ratios = [w / b for w, b in zip(rates["with"], rates["without"], strict=True)]
        print(
            f"{args.threads} threads x {args.names} fresh names, try-lock cycles/s: "
            f"with the registry {median(rates['with']):,.0f}, "
            f"without {median(rates['without']):,.0f}; "
            f"ratio (with / without, median of {args.reps} repetitions) {median(ratios):.3f} "
            f"(per repetition {min(ratios):.3f}-{max(ratios):.3f}); "
            f"names registered: {row[0] if row else 0}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
