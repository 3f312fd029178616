"""Workload G, used once ``pglock.pool_lock`` exists: pool-aware locking against a bare pool
checkout plus the raw statements, and the cost of ``pglock.reset_connection`` per checkout.

Every pool here has one connection (so each cycle reuses the same backend) and the same
settings; the cycles are alternated block by block as in workload A.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pglock

from ._adapters import sha256_key
from ._common import Context, pinned, rnd
from ._workloads import alternate, count_round_trips


def missing() -> str | None:
    """Why workload G cannot run (None when it can)."""
    absent = [n for n in ("pool_lock", "reset_connection") if not hasattr(pglock, n)]
    if absent:
        return f"pglock.{' and pglock.'.join(absent)} do(es) not exist yet (issue 4)"
    return None


def _pool(ctx: Context, *, autocommit: bool, reset: Callable[[Any], None] | None = None) -> Any:
    from psycopg_pool import ConnectionPool

    kwargs: dict[str, Any] = {"application_name": ctx.app_name}
    if autocommit:
        kwargs["autocommit"] = True
    return ConnectionPool(
        ctx.scratch_dsn,
        min_size=1,
        max_size=1,
        kwargs=kwargs,
        reset=reset,
        open=True,
        name="bench-G",
    )


def workload_g(ctx: Context) -> dict[str, Any]:
    s = ctx.settings
    name = ctx.lock_name("G", "pool")
    k = sha256_key(name)
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        pools = {
            key: stack.enter_context(_pool(ctx, autocommit=ac, reset=reset))
            for key, ac, reset in (
                ("raw-ac", True, None),
                ("lock-ac", True, None),
                ("raw-tx", False, None),
                ("lock-tx", False, None),
                ("plain", True, None),
                ("reset", True, pglock.reset_connection),
            )
        }

        def raw(pool: Any) -> Callable[[], None]:
            def run() -> None:
                with pool.connection() as c:
                    c.execute("SELECT pg_advisory_lock(%s)", (k,))
                    c.execute("SELECT pg_advisory_unlock(%s)", (k,))

            return run

        def locked(pool: Any) -> Callable[[], None]:
            def run() -> None:
                with pglock.pool_lock(pool, name):
                    pass

            return run

        def checkout(pool: Any) -> Callable[[], None]:
            def run() -> None:
                with pool.connection():
                    pass

            return run

        cycles = {
            "checkout+raw": raw(pools["raw-ac"]),
            "pool_lock": locked(pools["lock-ac"]),
            "checkout+raw (tx pool)": raw(pools["raw-tx"]),
            "pool_lock (tx pool)": locked(pools["lock-tx"]),
            "checkout": checkout(pools["plain"]),
            "checkout+reset_connection": checkout(pools["reset"]),
        }
        for pool in pools.values():
            pool.wait()  # each pool's one connection is open: its backend can be pinned
        with pinned(ctx) as pin:
            res = alternate(
                cycles,
                blocks=s.blocks,
                per_block=s.cycles_per_block,
                floor="checkout+raw",
                pairs=[("pool_lock (tx pool)", "checkout+raw (tx pool)")],
            )
        out["pinned"] = pin
        for (key, f), pool in zip(cycles.items(), pools.values(), strict=True):
            if "error" not in res[key]:
                # The pool's one connection, traced by libpq: exact, whatever pglock calls.
                conn = pool.getconn()
                pool.putconn(conn)
                res[key]["round_trips"] = count_round_trips(f, conns=[conn])
    out["cycles"] = res
    out["round_trips_counted_by"] = "libpq trace"
    floor = "checkout+raw"
    out["floor"] = floor

    def rel(a: str, b: str) -> float | None:
        ra, rb = res.get(a, {}).get("ratio"), res.get(b, {}).get("ratio")
        return rnd(ra / rb, 3) if ra and rb else None

    out["pool_lock_ratio"] = res.get("pool_lock", {}).get("ratio")
    out["pool_lock_ratio_tx_pool"] = rel("pool_lock (tx pool)", "checkout+raw (tx pool)")
    direct = res.get("pool_lock (tx pool)", {}).get("vs", {}).get("checkout+raw (tx pool)", {})
    out["pool_lock_ratio_tx_pool_direct"] = direct.get("ratio")
    plain, reset = res.get("checkout", {}), res.get("checkout+reset_connection", {})
    if plain.get("p50_us") and reset.get("p50_us"):
        out["reset_cost_us"] = rnd(reset["p50_us"] - plain["p50_us"], 1)
        out["reset_cost_cpu_us"] = rnd(reset["cpu_us"] - plain["cpu_us"], 1)
        out["reset_round_trips"] = rnd(reset["round_trips"] - plain["round_trips"], 2)
    return out
