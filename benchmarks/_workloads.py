"""Workloads A-D on any :class:`~benchmarks._adapters.Adapter`.

A  uncontended acquire+release cycles, adapters alternated block by block with the raw floor
B  N threads, distinct names, one session each: total cycles per second
C  handoff: a holder releases, a blocked waiter acquires: release -> acquired latency
D  N threads on one name: acquisitions per second, with a lost-update check
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pglock

from . import _adapters
from ._adapters import Adapter, Client
from ._common import (
    Context,
    median,
    percentile,
    rnd,
    trace_round_trips,
    wait_until,
)

# --- the alternating-blocks engine (A and G) ---------------------------------------------------


def alternate(
    cycles: dict[str, Callable[[], None]],
    *,
    blocks: int,
    per_block: int,
    floor: str,
    warmup: int = 20,
) -> dict[str, dict[str, Any]]:
    """Time each callable ``per_block`` times per block, for ``blocks`` blocks, rotating the
    order every block so that every one of them sees the same machine speed as the floor.

    Returns, per key: p50/p99/mean latency (µs) over all cycles, the median over blocks of
    cycles per second, the ratio of medians against ``floor`` and the spread of the per-block
    ratios (each block paired with the floor's block of the same round).
    """
    failed: dict[str, str] = {}
    for key, f in cycles.items():
        try:
            for _ in range(warmup):
                f()
        except Exception as exc:
            failed[key] = repr(exc)
    live = [k for k in cycles if k not in failed]
    lat: dict[str, list[float]] = {k: [] for k in live}
    block_p50: dict[str, list[float]] = {k: [] for k in live}
    rate: dict[str, list[float]] = {k: [] for k in live}
    clock = time.perf_counter_ns
    for b in range(blocks):
        shift = b % max(1, len(live))
        for key in live[shift:] + live[:shift]:
            if key in failed:
                continue
            f = cycles[key]
            samples: list[float] = []
            try:
                start = clock()
                for _ in range(per_block):
                    t = clock()
                    f()
                    samples.append((clock() - t) / 1000.0)
                elapsed = (clock() - start) / 1e9
            except Exception as exc:
                failed[key] = repr(exc)
                continue
            lat[key].extend(samples)
            block_p50[key].append(median(samples))
            rate[key].append(per_block / elapsed)
    out: dict[str, dict[str, Any]] = {}
    floor_p50 = median(lat[floor]) if lat.get(floor) else float("nan")
    for key in cycles:
        if key in failed:
            out[key] = {"error": failed[key]}
            continue
        p50 = median(lat[key])
        paired = [
            a / f for a, f in zip(block_p50[key], block_p50.get(floor, []), strict=False) if f > 0
        ]
        out[key] = {
            "p50_us": rnd(p50, 1),
            "p99_us": rnd(percentile(lat[key], 99), 1),
            "mean_us": rnd(sum(lat[key]) / len(lat[key]), 1),
            "cycles_per_s": rnd(median(rate[key]), 0),
            "ratio": rnd(p50 / floor_p50, 3),
            "ratio_blocks": [rnd(min(paired), 3), rnd(median(paired), 3), rnd(max(paired), 3)]
            if paired
            else None,
            "cycles": len(lat[key]),
        }
    return out


def _cycle(client: Client, name: str) -> Callable[[], None]:
    def run() -> None:
        client.acquire(name)
        client.release()

    return run


def round_trips_per_cycle(client: Client, name: str, n: int = 5) -> float | None:
    """Exact round trips per cycle from libpq's protocol trace (None if the client hides its
    connections)."""
    conns = client.conns()
    if not conns:
        return None
    for _ in range(8):  # warm: probes, and psycopg prepares a statement at its 5th use
        client.acquire(name)
        client.release()
    with trace_round_trips(conns) as count:
        for _ in range(n):
            client.acquire(name)
            client.release()
    return count() / n


# --- A -------------------------------------------------------------------------------------------


def workload_a(ctx: Context, adapters: Sequence[Adapter]) -> dict[str, Any]:
    """Uncontended acquire+release, all adapters alternated block by block."""
    s = ctx.settings
    chosen = [a for a in adapters if "A" in a.workloads]
    with contextlib.ExitStack() as stack:
        cycles: dict[str, Callable[[], None]] = {}
        rts: dict[str, float | None] = {}
        for a in chosen:
            (client,) = stack.enter_context(_adapters.clients(a, ctx, 1))
            name = ctx.lock_name("A", a.key)
            cycles[a.key] = _cycle(client, name)
            try:
                rts[a.key] = round_trips_per_cycle(client, name)
            except Exception as exc:
                rts[a.key] = None
                ctx.note(f"A: round-trip count for {a.key} failed: {exc!r}")
        res = alternate(cycles, blocks=s.blocks, per_block=s.cycles_per_block, floor="raw")
    for a in chosen:
        res[a.key].update(label=a.label, group=a.group, round_trips=rts.get(a.key))
    out: dict[str, Any] = {"floor": "raw", "adapters": res}
    single, multi = res.get("pglock", {}), res.get("pglock-10", {})
    if single.get("p50_us") and multi.get("p50_us"):
        out["multi_key_ratio"] = rnd(multi["p50_us"] / single["p50_us"], 3)
    raw_multi = res.get("raw-10", {})
    if multi.get("p50_us") and raw_multi.get("p50_us"):
        out["multi_key_vs_raw_multi"] = rnd(multi["p50_us"] / raw_multi["p50_us"], 3)
    px, rx = res.get("pglock-xact", {}), res.get("raw-xact", {})
    if px.get("p50_us") and rx.get("p50_us"):
        out["xact"] = {"ratio_vs_raw_xact": rnd(px["p50_us"] / rx["p50_us"], 3)}
        out["xact"].update(xact_round_trips(ctx))
    return out


def xact_round_trips(ctx: Context) -> dict[str, int]:
    """Round trips that the lock statement itself and the following COMMIT take, inside a
    caller's transaction, for pglock.xact_lock and the raw statement."""
    name = ctx.lock_name("A", "xact-rt")
    key = _adapters.sha256_key(name)
    out: dict[str, int] = {}
    with ctx.connect() as conn:
        with conn.transaction():
            pglock.xact_lock(conn, name)  # first use probes the server once per connection
        for label, lock in (
            ("pglock", lambda: pglock.xact_lock(conn, name)),
            ("raw", lambda: conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))),
        ):
            tx = conn.transaction()
            tx.__enter__()
            with trace_round_trips([conn]) as in_lock:
                lock()
            with trace_round_trips([conn]) as at_commit:
                tx.__exit__(None, None, None)
            out[f"{label}_lock_round_trips"] = in_lock()
            out[f"{label}_commit_round_trips"] = at_commit()
    return out


# --- B and D: threads ---------------------------------------------------------------------------


COUNTER_DDL = "CREATE TABLE IF NOT EXISTS bench_counter (name text PRIMARY KEY, n bigint NOT NULL)"


def contend(
    ctx: Context,
    adapter: Adapter,
    *,
    threads: int,
    seconds: float,
    same_name: bool,
    counter: bool,
    between: Callable[[], None] | None = None,
    max_cycles: int | None = None,
) -> dict[str, Any]:
    """``threads`` threads, each with its own client, cycle for ``seconds`` on one shared name
    (``same_name``) or on a name each. With ``counter``, each cycle reads a counter row and
    writes it back plus one, non-atomically, on a separate connection of the thread, under the
    lock; the final row must equal the number of cycles (``between`` runs between the read and
    the write: the negative control uses it to force two readers to interleave)."""
    tag = "D" if same_name else "B"
    shared = ctx.lock_name(tag, adapter.key)
    names = [shared if same_name else f"{shared}:{i}" for i in range(threads)]
    counts = [0] * threads
    errors: list[str] = []
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        cls = stack.enter_context(_adapters.clients(adapter, ctx, threads))
        counter_conns = []
        if counter:
            for _ in range(threads):
                c = stack.enter_context(ctx.connect())
                counter_conns.append(c)
            counter_conns[0].execute(COUNTER_DDL)
            counter_conns[0].execute(
                "INSERT INTO bench_counter (name, n) VALUES (%s, 0)", (shared,)
            )
        ready = threading.Barrier(threads + 1, timeout=30)

        def worker(i: int) -> None:
            client = cls[i]
            cc = counter_conns[i] if counter else None
            n = 0
            try:
                ready.wait()
                while not stop.is_set() and (max_cycles is None or n < max_cycles):
                    client.acquire(names[i])
                    try:
                        if cc is not None:
                            row = cc.execute(
                                "SELECT n FROM bench_counter WHERE name = %s", (shared,)
                            ).fetchone()
                            assert row is not None
                            if between is not None:
                                between()
                            cc.execute(
                                "UPDATE bench_counter SET n = %s WHERE name = %s",
                                (row[0] + 1, shared),
                            )
                    finally:
                        client.release()
                    n += 1
            except Exception as exc:
                errors.append(f"thread {i}: {exc!r}")
            finally:
                counts[i] = n

        ts = [
            threading.Thread(target=worker, args=(i,), name=f"bench-{tag}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in ts:
            t.start()
        ready.wait()
        t0 = time.perf_counter()
        for t in ts:  # until the time is up, or every thread did its max_cycles
            t.join(timeout=max(0.0, t0 + seconds - time.perf_counter()))
        stop.set()
        for t in ts:
            t.join(timeout=30)
        elapsed = time.perf_counter() - t0
        hung = [t.name for t in ts if t.is_alive()]
        if hung:
            errors.append(f"threads still running after the deadline: {hung}")
        total = sum(counts)
        out: dict[str, Any] = {
            "threads": threads,
            "cycles": total,
            "seconds": rnd(elapsed, 3),
            "cycles_per_s": rnd(total / elapsed, 1) if elapsed > 0 else None,
        }
        if counter:
            row = (
                counter_conns[0]
                .execute("SELECT n FROM bench_counter WHERE name = %s", (shared,))
                .fetchone()
            )
            final = row[0] if row else None
            out.update(
                counter=final,
                lost_updates=None if final is None else total - final,
                exact=final == total,
            )
        if errors:
            out["errors"] = errors
        return out


def workload_threads(
    ctx: Context, adapters: Sequence[Adapter], *, same_name: bool
) -> dict[str, Any]:
    """B (distinct names) or D (one name, with the lost-update check), alternated between
    adapters over repetitions; ratios against the raw floor of the same repetition."""
    s = ctx.settings
    tag = "D" if same_name else "B"
    chosen = [a for a in adapters if tag in a.workloads]
    runs: dict[str, list[dict[str, Any]]] = {a.key: [] for a in chosen}
    for rep in range(s.reps):
        shift = rep % len(chosen)
        for a in chosen[shift:] + chosen[:shift]:
            try:
                r = contend(
                    ctx,
                    a,
                    threads=s.threads,
                    seconds=s.seconds,
                    same_name=same_name,
                    counter=same_name,
                )
            except Exception as exc:
                r = {"errors": [repr(exc)]}
            runs[a.key].append(r)
    out: dict[str, Any] = {"threads": s.threads, "seconds": s.seconds, "floor": "raw"}
    floor_rates = [r.get("cycles_per_s") or 0.0 for r in runs.get("raw", [])]
    res: dict[str, Any] = {}
    for a in chosen:
        rs = runs[a.key]
        rates = [r["cycles_per_s"] for r in rs if r.get("cycles_per_s") is not None]
        paired = [
            x / f
            for x, f in zip([r.get("cycles_per_s") or 0.0 for r in rs], floor_rates, strict=False)
            if f > 0
        ]
        entry: dict[str, Any] = {
            "label": a.label,
            "group": a.group,
            "cycles_per_s": rnd(median(rates), 1) if rates else None,
            "ratio": rnd(median(paired), 3) if paired else None,
            "runs": rs,
        }
        if same_name:
            entry["exact"] = all(r.get("exact") for r in rs) and bool(rs)
            entry["lost_updates"] = sum(r.get("lost_updates") or 0 for r in rs)
        errs = [e for r in rs for e in r.get("errors", [])]
        if errs:
            entry["errors"] = errs
        res[a.key] = entry
    out["adapters"] = res
    return out


# --- C: handoff ----------------------------------------------------------------------------------

ADVISORY_WAITERS = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def handoff(
    ctx: Context, adapter: Adapter, rounds: int, wait_timeout: float = 30.0
) -> dict[str, Any]:
    """Holder (this thread) releases while a waiter thread is blocked in acquire; the waiter
    records the time it got the lock against a monotonic timestamp taken just before release.

    Postgres waits are confirmed in pg_locks before each release; polling and Redis waiters get
    a random 30-130 ms head start instead, so a poller's phase is uniformly random."""
    name = ctx.lock_name("C", adapter.key)
    samples: list[float] = []
    errors: list[str] = []
    t_release = [0.0]
    go, started, done = threading.Event(), threading.Event(), threading.Event()
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        holder, waiter = stack.enter_context(_adapters.clients(adapter, ctx, 2))
        monitor = stack.enter_context(ctx.connect())

        def waiter_loop() -> None:
            try:
                for _ in range(rounds):
                    if not go.wait(wait_timeout) or stop.is_set():
                        return
                    go.clear()
                    started.set()
                    waiter.acquire(name)
                    samples.append(time.perf_counter() - t_release[0])
                    waiter.release()
                    done.set()
            except Exception as exc:
                errors.append(repr(exc))
                done.set()

        t = threading.Thread(target=waiter_loop, name="bench-C-waiter", daemon=True)
        t.start()
        try:
            for _ in range(rounds):
                holder.acquire(name)
                try:
                    go.set()
                    if not started.wait(wait_timeout):
                        errors.append("waiter did not start")
                        break
                    started.clear()
                    if waiter.waits_in_postgres:

                        def blocked() -> bool:
                            row = monitor.execute(ADVISORY_WAITERS).fetchone()
                            return bool(row and row[0])

                        if not wait_until(blocked, wait_timeout):
                            errors.append("waiter never showed up in pg_locks")
                            break
                    else:
                        time.sleep(random.uniform(0.03, 0.13))
                    t_release[0] = time.perf_counter()
                finally:
                    holder.release()
                if not done.wait(wait_timeout):
                    errors.append("waiter did not get the lock in time")
                    break
                done.clear()
                if errors:
                    break
        finally:
            stop.set()
            go.set()  # let a waiting waiter thread end
            t.join(timeout=wait_timeout)
    ms = [x * 1000 for x in samples]
    out: dict[str, Any] = {
        "label": adapter.label,
        "group": adapter.group,
        "polls": adapter.polls,
        "handoffs": len(ms),
        "p50_ms": rnd(median(ms), 3),
        "p99_ms": rnd(percentile(ms, 99), 3),
        "mean_ms": rnd(sum(ms) / len(ms), 3) if ms else None,
    }
    if errors:
        out["errors"] = errors
    return out


def workload_c(ctx: Context, adapters: Sequence[Adapter]) -> dict[str, Any]:
    s = ctx.settings
    res: dict[str, Any] = {}
    for a in adapters:
        if "C" not in a.workloads:
            continue
        rounds = s.handoffs_polled if a.polls else s.handoffs
        try:
            res[a.key] = handoff(ctx, a, rounds)
        except Exception as exc:
            res[a.key] = {"label": a.label, "group": a.group, "errors": [repr(exc)]}
    floor = (res.get("raw") or {}).get("p50_ms")
    for r in res.values():
        if floor and r.get("p50_ms"):
            r["ratio"] = rnd(r["p50_ms"] / floor, 2)
    return {"floor": "raw", "adapters": res}
