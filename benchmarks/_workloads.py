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
    StatementCounter,
    median,
    percentile,
    pinned,
    rnd,
    trace_round_trips,
    wait_until,
)

# --- the alternating-blocks engine (A and G) ---------------------------------------------------


class _Block:
    """One block of timed cycles."""

    def __init__(self, f: Callable[[], None], n: int) -> None:
        clock = time.perf_counter_ns
        samples: list[float] = []
        cpu0 = time.thread_time()
        start = clock()
        for _ in range(n):
            t = clock()
            f()
            samples.append((clock() - t) / 1000.0)
        self.elapsed = (clock() - start) / 1e9
        self.cpu_us = (time.thread_time() - cpu0) * 1e6 / n
        self.samples = samples
        self.p50 = median(samples)


def _warm_up(cycles: dict[str, Callable[[], None]], warmup: int) -> dict[str, str]:
    """Run every callable ``warmup`` times; the ones that raise, with the error."""
    failed: dict[str, str] = {}
    for key, f in cycles.items():
        try:
            for _ in range(warmup):
                f()
        except Exception as exc:
            failed[key] = repr(exc)
    return failed


def _block_pair(
    floor_f: Callable[[], None], f: Callable[[], None], per_block: int, *, floor_first: bool
) -> tuple[_Block, _Block]:
    """(floor block, X block), timed back to back in the order given."""
    if floor_first:
        fb = _Block(floor_f, per_block)
        xb = _Block(f, per_block)
    else:
        xb = _Block(f, per_block)
        fb = _Block(floor_f, per_block)
    return fb, xb


def _run_blocks(
    cycles: dict[str, Callable[[], None]],
    jobs: list[tuple[str, str]],
    failed: dict[str, str],
    *,
    blocks: int,
    per_block: int,
) -> dict[tuple[str, str], list[tuple[_Block, _Block]]]:
    """The timed rounds of :func:`alternate`: for every job (X, against), the (against block,
    X block) pairs of each round. A key whose block raises goes into ``failed`` and is not run
    again."""
    out: dict[tuple[str, str], list[tuple[_Block, _Block]]] = {job: [] for job in jobs}
    for b in range(blocks):
        shift = b % max(1, len(jobs))
        for key, against in jobs[shift:] + jobs[:shift]:
            if key in failed or against in failed:
                continue
            try:
                fb, xb = _block_pair(
                    cycles[against], cycles[key], per_block, floor_first=b % 2 == 0
                )
            except Exception as exc:
                failed[key] = repr(exc)
                continue
            out[(key, against)].append((fb, xb))
    return out


def _block_figures(mine: list[_Block], per_block: int) -> tuple[dict[str, Any], float]:
    """(the figures of one key over its blocks, its unrounded p50)."""
    lat = [x for blk in mine for x in blk.samples]
    p50 = median(lat)
    entry: dict[str, Any] = {
        "p50_us": rnd(p50, 1),
        "p99_us": rnd(percentile(lat, 99), 1),
        "mean_us": rnd(sum(lat) / len(lat), 1) if lat else None,
        "cpu_us": rnd(median([blk.cpu_us for blk in mine]), 1),
        "cycles_per_s": rnd(median([per_block / blk.elapsed for blk in mine]), 0),
        "cycles": len(lat),
    }
    return entry, p50


def _vs_floor(pairs: list[tuple[_Block, _Block]], p50: float, cpu_us: Any) -> dict[str, Any]:
    """The ratios of one key against the blocks paired with it ((against, mine) per round)."""
    fl, mine = [f for f, _ in pairs], [x for _, x in pairs]
    floor_p50 = median([x for blk in fl for x in blk.samples])
    per_round = [x.p50 / f.p50 for f, x in pairs if f.p50 > 0]
    floor_cpu = median([blk.cpu_us for blk in fl])
    return {
        "ratio": rnd(p50 / floor_p50, 3),
        "cpu_ratio": rnd(cpu_us / floor_cpu, 3) if floor_cpu > 0 else None,
        # client CPU per cycle above the paired blocks: median over rounds of the difference
        "cpu_diff_us": rnd(median([x.cpu_us - f.cpu_us for f, x in pairs]), 1),
        "floor_p50_us": rnd(floor_p50, 1),
        "ratio_blocks": [
            rnd(min(per_round), 3),
            rnd(median(per_round), 3),
            rnd(max(per_round), 3),
        ]
        if per_round
        else None,
        "rounds": len(mine),
    }


def alternate(
    cycles: dict[str, Callable[[], None]],
    *,
    blocks: int,
    per_block: int,
    floor: str,
    warmup: int = 20,
    pairs: Sequence[tuple[str, str]] = (),
) -> dict[str, dict[str, Any]]:
    """Time every callable against ``floor`` in adjacent blocks of ``per_block`` cycles.

    Each of ``blocks`` rounds runs, for every other callable X (in a rotating order), a block of
    the floor and a block of X back to back (which one goes first alternates), so that X and
    the floor blocks it is compared with see the same machine speed even on a noisy machine.

    Returns, per key: p50/p99/mean wall latency (µs) over all cycles; client CPU per cycle (µs,
    median over blocks; this thread only); cycles per second (median over blocks); ``ratio``,
    the p50 of X over the p50 of the floor blocks paired with X (the ratio of medians); and the
    min/median/max of the per-round ratios. The floor's own figures pool all its blocks.

    ``pairs`` adds direct comparisons (X, Y): blocks of X next to blocks of Y in the same
    rounds, reported as ``out[X]["vs"][Y]`` (the same figures as against the floor). They say
    how X compares with Y without going through the floor, whose own speed may be off in a run.
    """
    failed = _warm_up(cycles, warmup)
    if floor in failed:
        raise RuntimeError(f"the floor {floor!r} failed: {failed[floor]}")
    others = [k for k in cycles if k != floor and k not in failed]
    extra = [(x, y) for x, y in pairs if x in others and y in cycles and y not in failed]
    runs = _run_blocks(
        cycles, [(k, floor) for k in others] + extra, failed, blocks=blocks, per_block=per_block
    )
    out: dict[str, dict[str, Any]] = {}
    for key in cycles:
        if key in failed:
            out[key] = {"error": failed[key]}
            continue
        if key == floor:
            mine = [f for k in others for f, _ in runs[(k, floor)]]
        else:
            mine = [x for _, x in runs[(key, floor)]]
        entry, p50 = _block_figures(mine, per_block)
        if key == floor:
            entry.update(ratio=1.0, cpu_ratio=1.0, ratio_blocks=[1.0, 1.0, 1.0])
        else:
            entry.update(_vs_floor(runs[(key, floor)], p50, entry["cpu_us"]))
        out[key] = entry
    for x, y in extra:
        if x in failed or y in failed or not runs[(x, y)]:
            continue
        _, p50 = _block_figures([xb for _, xb in runs[(x, y)]], per_block)
        cpu = median([xb.cpu_us for _, xb in runs[(x, y)]])
        out[x].setdefault("vs", {})[y] = _vs_floor(runs[(x, y)], p50, cpu)
    return out


def _cycle(client: Client, name: str) -> Callable[[], None]:
    def run() -> None:
        client.acquire(name)
        client.release()

    return run


def round_trips_per_cycle(client: Client, name: str, n: int = 5) -> float:
    """Round trips per cycle: exact from libpq's protocol trace when the client shows its
    connections, else counted at psycopg's execute/command calls (connections a library
    opens itself, as pals does through SQLAlchemy)."""
    for _ in range(8):  # warm: probes, and psycopg prepares a statement at its 5th use
        client.acquire(name)
        client.release()
    return count_round_trips(_cycle(client, name), n, client.conns())


def count_round_trips(f: Callable[[], object], n: int = 5, conns: Sequence[Any] = ()) -> float:
    """Round trips per call of ``f`` (see :func:`round_trips_per_cycle`)."""
    if conns:
        with trace_round_trips(conns) as count:
            for _ in range(n):
                f()
        return count() / n
    with StatementCounter() as counter:
        for _ in range(n):
            f()
    return counter.total / n


# --- A -------------------------------------------------------------------------------------------

#: Direct comparisons in A (X next to Y in the same rounds, besides both next to the floor):
#: the pairs that issue 13's targets compare.
A_PAIRS = (
    ("pglock", "postgresql-lock"),
    ("pglock-10", "raw-10"),
    ("pglock-xact", "raw-xact"),
    ("lease", "ttl-table"),
)


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
                if a.group != "redis":
                    rts[a.key] = round_trips_per_cycle(client, name)
            except Exception as exc:
                rts[a.key] = None
                ctx.note(f"A: round-trip count for {a.key} failed: {exc!r}")
        # Every client has connected by now (the round-trip count ran a cycle on each).
        with pinned(ctx) as pin:
            res = alternate(
                cycles, blocks=s.blocks, per_block=s.cycles_per_block, floor="raw", pairs=A_PAIRS
            )
    for a in chosen:
        res[a.key].update(label=a.label, group=a.group, round_trips=rts.get(a.key))
    out: dict[str, Any] = {"floor": "raw", "adapters": res, "pinned": pin}

    # Ratios between two adapters go through their own floor-normalized ratios: each was
    # measured next to the floor, not next to the other.
    def rel(a: str, b: str) -> float | None:
        ra, rb = res.get(a, {}).get("ratio"), res.get(b, {}).get("ratio")
        return rnd(ra / rb, 3) if ra and rb else None

    out["multi_key_ratio"] = rel("pglock-10", "pglock")
    out["multi_key_vs_raw_multi"] = rel("pglock-10", "raw-10")
    if rel("pglock-xact", "raw-xact") is not None:
        out["xact"] = {"ratio_vs_raw_xact": rel("pglock-xact", "raw-xact")}
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


def _counter_connections(
    stack: contextlib.ExitStack[Any], ctx: Context, threads: int, shared: str
) -> list[Any]:
    """A counter connection per thread (entered on ``stack``), with the counter row at 0."""
    counter_conns = []
    for _ in range(threads):
        c = stack.enter_context(ctx.connect())
        counter_conns.append(c)
    counter_conns[0].execute(COUNTER_DDL)
    counter_conns[0].execute("INSERT INTO bench_counter (name, n) VALUES (%s, 0)", (shared,))
    return counter_conns


def _bump_counter(cc: Any, shared: str, between: Callable[[], None] | None) -> None:
    """Read the counter row and write it back plus one, non-atomically."""
    row = cc.execute("SELECT n FROM bench_counter WHERE name = %s", (shared,)).fetchone()
    assert row is not None
    if between is not None:
        between()
    cc.execute(
        "UPDATE bench_counter SET n = %s WHERE name = %s",
        (row[0] + 1, shared),
    )


def _counter_check(conn: Any, shared: str, total: int) -> dict[str, Any]:
    """The final counter against the number of cycles."""
    row = conn.execute("SELECT n FROM bench_counter WHERE name = %s", (shared,)).fetchone()
    final = row[0] if row else None
    return {
        "counter": final,
        "lost_updates": None if final is None else total - final,
        "exact": final == total,
    }


def _join_threads(ts: list[threading.Thread], stop: threading.Event, seconds: float) -> float:
    """Let the threads run for ``seconds`` (or until they all end), stop them, and return the
    elapsed time."""
    t0 = time.perf_counter()
    for t in ts:  # until the time is up, or every thread did its max_cycles
        t.join(timeout=max(0.0, t0 + seconds - time.perf_counter()))
    stop.set()
    for t in ts:
        t.join(timeout=30)
    return time.perf_counter() - t0


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
    # B: 100 names per thread, taken in turn (the workload: a name registry or a cache
    # per name must show up here); D: the one shared name.
    per = 1 if same_name else NAMES_PER_THREAD
    names = [
        [shared] if same_name else [f"{shared}:{i}:{j}" for j in range(per)]
        for i in range(threads)
    ]
    counts = [0] * threads
    errors: list[str] = []
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        cls = stack.enter_context(_adapters.clients(adapter, ctx, threads))
        counter_conns = _counter_connections(stack, ctx, threads, shared) if counter else []
        ready = threading.Barrier(threads + 1, timeout=30)

        def worker(i: int) -> None:
            client = cls[i]
            cc = counter_conns[i] if counter else None
            n = 0
            try:
                ready.wait()
                while not stop.is_set() and (max_cycles is None or n < max_cycles):
                    client.acquire(names[i][n % per])
                    try:
                        if cc is not None:
                            _bump_counter(cc, shared, between)
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
        elapsed = _join_threads(ts, stop, seconds)
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
            out.update(_counter_check(counter_conns[0], shared, total))
        if errors:
            out["errors"] = errors
        return out


#: Distinct names each thread of B takes in turn.
NAMES_PER_THREAD = 100


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


def _let_waiter_block(waiter: Client, monitor: Any, wait_timeout: float) -> bool:
    """Give the waiter time to block: a Postgres wait is confirmed in pg_locks (False if it
    never shows up); a polling or Redis waiter gets a random 30-130 ms head start."""
    if not waiter.waits_in_postgres:
        time.sleep(random.uniform(0.03, 0.13))
        return True

    def blocked() -> bool:
        row = monitor.execute(ADVISORY_WAITERS).fetchone()
        return bool(row and row[0])

    return wait_until(blocked, wait_timeout)


def _handoff_figures(adapter: Adapter, samples: list[float], errors: list[str]) -> dict[str, Any]:
    """The result of :func:`handoff`: latencies in ms."""
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
                    if not _let_waiter_block(waiter, monitor, wait_timeout):
                        errors.append("waiter never showed up in pg_locks")
                        break
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
    return _handoff_figures(adapter, samples, errors)


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
        res.update(a.extra_handoffs(ctx, rounds))
    floor = (res.get("raw") or {}).get("p50_ms")
    for r in res.values():
        if floor and r.get("p50_ms"):
            r["ratio"] = rnd(r["p50_ms"] / floor, 2)
    return {"floor": "raw", "adapters": res}
