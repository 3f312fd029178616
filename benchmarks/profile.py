"""Where pglock's time goes in one uncontended cycle, against the raw statements.

    python -m benchmarks.profile [pg_lock|xact_lock|pool_lock|lease|lease-nondurable ...]
                                 [--dsn DSN] [--cycles 3000]

For each target, in a throwaway database:

1. Client CPU per cycle (this thread's CPU time, which scheduling noise barely touches), the
   pglock cycle and its raw counterpart alternating in blocks: the difference is what pglock's
   Python code costs per cycle, whatever the round trip costs on the day.
2. Round trips per cycle of both.
3. A pyinstrument profile of the pglock cycle with real I/O: time inside psycopg is the same
   work the raw statements do; the rest is pglock's own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg

import pglock

from ._adapters import sha256_key
from ._common import APP_NAME, dsn_with_db, median, scratch_database
from ._workloads import count_round_trips

Cycle = Callable[[], None]
_pglock: Any = pglock


def cpu_per_cycle(f: Cycle, n: int) -> float:
    t = time.thread_time()
    for _ in range(n):
        f()
    return (time.thread_time() - t) * 1e6 / n


Cycles = tuple[Cycle, Cycle, str]


def _connect(
    stack: contextlib.ExitStack[Any], dsn: str, autocommit: bool = True
) -> psycopg.Connection[Any]:
    return stack.enter_context(
        psycopg.connect(dsn, autocommit=autocommit, application_name=APP_NAME)
    )


def _raw_on(c: psycopg.Connection[Any], k: int) -> Cycle:
    def raw() -> None:
        c.execute("SELECT pg_advisory_lock(%s)", (k,))
        c.execute("SELECT pg_advisory_unlock(%s)", (k,))

    return raw


def _pg_lock_cycles(stack: contextlib.ExitStack[Any], dsn: str, name: str, k: int) -> Cycles:
    c = _connect(stack, dsn)

    def pg() -> None:
        with pglock.pg_lock(c, name):
            pass

    return pg, _raw_on(_connect(stack, dsn), k), "pg_advisory_lock + unlock"


def _xact_lock_cycles(stack: contextlib.ExitStack[Any], dsn: str, name: str, k: int) -> Cycles:
    c1, c2 = _connect(stack, dsn), _connect(stack, dsn)

    def xact() -> None:
        with c1.transaction():
            pglock.xact_lock(c1, name)

    def raw_xact() -> None:
        with c2.transaction():
            c2.execute("SELECT pg_advisory_xact_lock(%s)", (k,))

    return xact, raw_xact, "BEGIN; pg_advisory_xact_lock; COMMIT"


def _pool_lock_cycles(stack: contextlib.ExitStack[Any], dsn: str, name: str, k: int) -> Cycles:
    from psycopg_pool import ConnectionPool

    def pool() -> Any:
        return stack.enter_context(
            ConnectionPool(
                dsn,
                min_size=1,
                max_size=1,
                kwargs={"application_name": APP_NAME, "autocommit": True},
                open=True,
            )
        )

    p1, p2 = pool(), pool()

    def locked() -> None:
        with pglock.pool_lock(p1, name):
            pass

    def checkout_raw() -> None:
        with p2.connection() as c:
            c.execute("SELECT pg_advisory_lock(%s)", (k,))
            c.execute("SELECT pg_advisory_unlock(%s)", (k,))

    return locked, checkout_raw, "pool checkout + pg_advisory_lock + unlock"


def _lease_cycles(
    stack: contextlib.ExitStack[Any], dsn: str, name: str, k: int, *, durable: bool = True
) -> Cycles:
    from psycopg_pool import ConnectionPool

    from ._leases import install_schema

    err = install_schema(dsn)
    if err:
        raise RuntimeError(err)
    lp = stack.enter_context(
        ConnectionPool(
            dsn, min_size=1, max_size=2, kwargs={"application_name": APP_NAME}, open=True
        )
    )

    def lease() -> None:
        with _pglock.lease(lp, name, ttl=30, durable=durable):
            pass

    return lease, _raw_on(_connect(stack, dsn), k), "pg_advisory_lock + unlock"


def _lease_nondurable_cycles(
    stack: contextlib.ExitStack[Any], dsn: str, name: str, k: int
) -> Cycles:
    return _lease_cycles(stack, dsn, name, k, durable=False)


TARGETS: dict[str, Callable[[contextlib.ExitStack[Any], str, str, int], Cycles]] = {
    "pg_lock": _pg_lock_cycles,
    "xact_lock": _xact_lock_cycles,
    "pool_lock": _pool_lock_cycles,
    "lease": _lease_cycles,
    "lease-nondurable": _lease_nondurable_cycles,
}


@contextlib.contextmanager
def cycles(target: str, dsn: str) -> Iterator[Cycles]:
    """(pglock cycle, raw cycle, what the raw one is) for ``target``."""
    name = f"bench:profile:{target}"
    k = sha256_key(name)
    with contextlib.ExitStack() as stack:
        make = TARGETS.get(target)
        if make is None:
            raise SystemExit(f"unknown target {target!r}")
        yield make(stack, dsn, name, k)


def profile(target: str, dsn: str, n: int, blocks: int) -> None:
    with cycles(target, dsn) as (pg, raw, raw_label):
        for f in (raw, pg):
            for _ in range(50):
                f()
        per = max(1, n // blocks)
        cpu: dict[str, list[float]] = {"raw": [], "pglock": []}
        for b in range(blocks):
            order = [("raw", raw), ("pglock", pg)]
            for key, f in order if b % 2 == 0 else order[::-1]:
                cpu[key].append(cpu_per_cycle(f, per))
        r, g = median(cpu["raw"]), median(cpu["pglock"])
        print(f"\n=== {target} (raw: {raw_label})")
        print(
            f"client CPU per cycle (median of {blocks} blocks of {per}): raw {r:.1f} µs, "
            f"{target} {g:.1f} µs: {target} adds {g - r:.1f} µs of Python per cycle "
            f"({g / r:.2f}x)"
        )
        print(
            f"round trips per cycle: raw {count_round_trips(raw)}, {target} {count_round_trips(pg)}"
        )

        from pyinstrument import Profiler

        prof = Profiler(interval=0.0001)
        prof.start()
        for _ in range(n):
            pg()
        prof.stop()
        print(prof.output_text(unicode=False, color=False, show_all=False))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument("targets", nargs="*", default=["pg_lock"])
    p.add_argument(
        "--dsn",
        default=os.environ.get("PGLOCK_BENCH_DSN")
        or os.environ.get("PGLOCK_TEST_DSN")
        or "postgresql://postgres@127.0.0.1:5432/postgres",
    )
    p.add_argument("--cycles", type=int, default=3000)
    p.add_argument("--blocks", type=int, default=20)
    args = p.parse_args(argv)
    os.environ.setdefault("PYINSTRUMENT_IGNORE_OVERHEAD_WARNING", "1")
    with scratch_database(args.dsn, APP_NAME) as db:
        for target in args.targets:
            profile(target, dsn_with_db(args.dsn, db), args.cycles, args.blocks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
