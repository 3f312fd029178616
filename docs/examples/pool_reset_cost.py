"""Measure what pglock.reset_connection costs per checkout (the figure in docs/pools.md).

    python docs/examples/pool_reset_cost.py postgresql://postgres@127.0.0.1:5432/test

Three pools of size 1 (so every checkout waits for the previous return, reset included) do the
same checkout / ``SELECT 1`` / return cycle: without a reset hook, with a hook that does
nothing (psycopg_pool hands every return to its worker thread once any hook is set), and with
``pglock.reset_connection``. It also times the hook alone, called on an idle connection in a
loop. Medians of several rounds are printed.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg_pool

import pglock


def no_op(conn: psycopg.Connection[Any]) -> None:
    pass


def cycle_us(dsn: str, reset: Callable[[psycopg.Connection[Any]], None] | None, n: int) -> float:
    with psycopg_pool.ConnectionPool(dsn, min_size=1, max_size=1, reset=reset, open=False) as pool:
        pool.open(wait=True)
        for _ in range(50):  # warm up
            with pool.connection() as c:
                c.execute("SELECT 1")
        t0 = time.perf_counter()
        for _ in range(n):
            with pool.connection() as c:
                c.execute("SELECT 1")
        return (time.perf_counter() - t0) / n * 1e6


def hook_us(dsn: str, n: int) -> tuple[float, float]:
    """(reset_connection alone, a SELECT 1 round trip) on one idle connection, in us."""
    with psycopg.connect(dsn) as conn:
        for _ in range(50):
            pglock.reset_connection(conn)
        t0 = time.perf_counter()
        for _ in range(n):
            pglock.reset_connection(conn)
        t1 = time.perf_counter()
        conn.autocommit = True
        for _ in range(n):
            conn.execute("SELECT 1")
        t2 = time.perf_counter()
        return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def main() -> None:
    dsn = sys.argv[1] if len(sys.argv) > 1 else "postgresql://postgres@127.0.0.1:5432/test"
    n, rounds = 2000, 5
    with psycopg.connect(dsn) as c:
        server = c.info.server_version
    print(
        f"pglock {pglock.__version__}, psycopg {psycopg.__version__}, "
        f"psycopg_pool {psycopg_pool.__version__}, Postgres {server}, "
        f"Python {sys.version.split()[0]}"
    )
    results: dict[str, list[float]] = {"no hook": [], "no-op hook": [], "reset_connection": []}
    alone: list[float] = []
    trip: list[float] = []
    for _ in range(rounds):
        results["no hook"].append(cycle_us(dsn, None, n))
        results["no-op hook"].append(cycle_us(dsn, no_op, n))
        results["reset_connection"].append(cycle_us(dsn, pglock.reset_connection, n))
        hook, select1 = hook_us(dsn, n)
        alone.append(hook)
        trip.append(select1)
    base = statistics.median(results["no hook"])
    for label, values in results.items():
        med = statistics.median(values)
        print(f"checkout cycle, {label:17s}: {med:7.1f} us  (+{med - base:6.1f} us)")
    print(f"reset_connection alone     : {statistics.median(alone):7.1f} us per call")
    print(f"SELECT 1 round trip        : {statistics.median(trip):7.1f} us")


if __name__ == "__main__":
    main()
