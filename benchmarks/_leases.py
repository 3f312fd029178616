"""Lease workloads (E, F) and the lease adapter for A-D, used once ``pglock.lease`` exists.

E  keepalive of many leases held by one process: statements per second and per renewal round,
   CPU of the keepalive thread; lease acquire latency with a small versus a huge lease table
F  many waiters on one lease: database statements per handoff

Statements are counted client-side (:class:`~benchmarks._common.StatementCounter`: every round
trip psycopg sends, per thread), which is exact and needs no server setting.
"""

from __future__ import annotations

import contextlib
import json
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import pglock

from ._adapters import Adapter, Client
from ._common import (
    Context,
    StatementCounter,
    dsn_with_db,
    median,
    percentile,
    rnd,
    scratch_database,
    thread_cpu_seconds,
    wait_until,
)

LEASE_SCHEMA = "pglock"

# pglock.lease arrives with issue 3: reach it through Any so the harness type-checks before.
_pglock: Any = pglock


def missing() -> str | None:
    """Why the lease workloads cannot run (None when they can)."""
    if not hasattr(pglock, "lease"):
        return "pglock.lease does not exist yet (issue 3)"
    return None


def install_schema(dsn: str) -> str | None:
    """Install pglock's schema with the documented command; returns an error text or None."""
    cmd = [sys.executable, "-m", "pglock", "install", "--dsn", dsn]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(cmd[1:4])} failed: {exc!r}"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return f"'python -m pglock install' exited {proc.returncode}: {' | '.join(tail)}"
    return None


def make_pool(ctx: Context, dsn: str | None = None, *, max_size: int = 4) -> Any:
    from psycopg_pool import ConnectionPool

    return ConnectionPool(
        dsn or ctx.scratch_dsn,
        min_size=1,
        max_size=max_size,
        kwargs={"application_name": ctx.app_name},
        open=True,
        name="bench-lease",
    )


# --- the lease as an adapter (A-D) --------------------------------------------------------------


class _LeaseClient(Client):
    waits_in_postgres = False  # a lease waiter waits on LISTEN/NOTIFY, not in pg_locks

    def __init__(self, ctx: Context, **options: Any) -> None:
        self.pool = make_pool(ctx)
        self.options = options
        self._lease: Any = None

    def acquire(self, name: str) -> None:
        lease = _pglock.lease(self.pool, name, ttl=30.0, **self.options)
        lease.__enter__()
        self._lease = lease

    def release(self) -> None:
        lease, self._lease = self._lease, None
        lease.__exit__(None, None, None)

    def close(self) -> None:
        self.pool.close()


class Lease(Adapter):
    key = "lease"
    label = "pglock.lease (durable)"
    group = "lease"

    def __init__(self, **options: Any) -> None:
        self.options = options

    def client(self, ctx: Context) -> Client:
        return _LeaseClient(ctx, **self.options)

    def extra_handoffs(self, ctx: Context, rounds: int) -> dict[str, dict[str, Any]]:
        """The handoff to a waiter in another process (the same-process one is local); with
        ``--waiter-pglock``, then to one on that pglock too."""
        out: dict[str, dict[str, Any]] = {}
        for key, where in [("", None), ("-waiter-pglock", ctx.waiter_pglock)]:
            if key and where is None:
                continue
            try:
                r = handoff_cross_process(
                    ctx, rounds, durable=self.options.get("durable", True), pglock_dir=where
                )
            except Exception as exc:
                r = {"errors": [repr(exc)]}
            on = f" on pglock at {where}" if where else ""
            label = f"{self.label}, waiter in another process{on}"
            out[f"{self.key}-xproc{key}"] = {**r, "label": label, "group": self.group,
                                             "polls": False}
        return out


def _accepts_durable() -> bool:
    """Does pglock.lease take ``durable=``? (Its options are a TypedDict behind ``**options``,
    so ask the constructor, which sends nothing.)"""
    try:
        _pglock.lease("postgresql://127.0.0.1/bench", "bench:probe", durable=False)
    except TypeError:
        return False
    return True


def lease_adapters() -> list[Adapter]:
    """The lease adapter, plus a non-durable variant if pglock documents one."""
    out: list[Adapter] = [Lease()]
    if _accepts_durable():
        fast = Lease(durable=False)
        fast.key, fast.label = "lease-nondurable", "pglock.lease (durable=False)"
        out[0].label = "pglock.lease (durable)"
        out.append(fast)
    return out


# --- E: keepalive -------------------------------------------------------------------------------


def _in_threads(items: list[Any], fn: Any, threads: int = 4) -> None:
    """Call ``fn(item)`` for every item, from ``threads`` threads (bounded: items are finite)."""
    errors: list[BaseException] = []

    def run(chunk: list[Any]) -> None:
        try:
            for item in chunk:
                fn(item)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(items[i::threads],)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def keepalive(ctx: Context) -> dict[str, Any]:
    """Hold ``settings.leases`` leases with keepalive on; count what the process sends while it
    does nothing else, and the CPU its background threads use."""
    s = ctx.settings
    ttl = s.keepalive_ttl
    pool = make_pool(ctx, max_size=8)
    before = {t.ident for t in threading.enumerate()}
    out: dict[str, Any] = {"leases": s.leases, "ttl": ttl, "window_s": s.keepalive_window}
    leases = [_pglock.lease(pool, f"bench:E:{i}", ttl=ttl) for i in range(s.leases)]
    held: list[Any] = []
    try:
        t0 = time.perf_counter()

        def take(lease: Any) -> None:
            lease.__enter__()
            held.append(lease)

        _in_threads(leases, take)  # 4 threads: only to save wall time
        out["acquire_all_s"] = rnd(time.perf_counter() - t0, 2)
        time.sleep(min(ttl / 2, 2.0))  # let the keepalive settle
        # pglock's threads: those started since, and any keepalive started earlier.
        background = [
            t
            for t in threading.enumerate()
            if t.ident not in before or "keepalive" in t.name.lower()
        ]
        with StatementCounter() as counter:
            cpu0, proc0 = thread_cpu_seconds(background), time.process_time()
            start = time.perf_counter()
            time.sleep(s.keepalive_window)
            window = time.perf_counter() - start
            cpu1, proc1 = thread_cpu_seconds(background), time.process_time()
            counted = counter.snapshot()
            stamps = counter.stamps()
        lost = sum(1 for lease in held if getattr(lease, "lost", False))
    finally:
        t1 = time.perf_counter()
        try:
            _in_threads(held, lambda lease: lease.__exit__(None, None, None))
        finally:
            pool.close()
    out["release_all_s"] = rnd(time.perf_counter() - t1, 2)
    threads: dict[str, float] = {}
    for key in cpu1.keys() & cpu0.keys():
        name = key.split("#")[0]
        threads[name] = threads.get(name, 0.0) + cpu1[key] - cpu0[key]
    statements = sum(counted.values())
    rounds = _rounds(stamps)
    keep = {n: c for n, c in threads.items() if "keepalive" in n.lower() or "pglock" in n.lower()}
    keep_cpu = sum(keep.values()) if keep else sum(threads.values())
    out.update(
        statements=statements,
        statements_by_thread=dict(counted),
        statements_per_s=rnd(statements / window, 2),
        renewal_rounds=rounds,
        statements_per_round=rnd(statements / rounds, 2) if rounds else None,
        keepalive_threads=sorted(keep) or sorted(threads),
        keepalive_cpu_pct_of_core=rnd(100 * keep_cpu / window, 2),
        keepalive_cpu_ms_per_round=rnd(1000 * keep_cpu / rounds, 1) if rounds else None,
        process_cpu_pct_of_core=rnd(100 * (proc1 - proc0) / window, 2),
        leases_lost=lost,
    )
    return out


def _rounds(stamps: list[float], gap: float = 0.2) -> int:
    """Bursts of statements separated by at least ``gap`` seconds: the renewal rounds."""
    rounds, last = 0, None
    for t in sorted(stamps):
        if last is None or t - last > gap:
            rounds += 1
        last = t
    return rounds


# --- E: acquire latency against the size of the lease table ----------------------------------


def _lease_table(conn: psycopg.Connection[Any]) -> tuple[str, list[tuple[str, str, bool, bool]]]:
    """Find the lease table in pglock's schema: the table with ``name`` and ``expires_at``."""
    rows = conn.execute(
        "SELECT c.table_name FROM information_schema.columns c"
        " WHERE c.table_schema = %s AND c.column_name IN ('name', 'expires_at')"
        " GROUP BY c.table_name HAVING count(*) = 2",
        (LEASE_SCHEMA,),
    ).fetchall()
    if len(rows) != 1:
        raise RuntimeError(f"cannot tell the lease table in schema {LEASE_SCHEMA!r}: {rows}")
    table = rows[0][0]
    cols = conn.execute(
        "SELECT column_name, data_type, is_nullable = 'NO', column_default IS NOT NULL"
        " FROM information_schema.columns WHERE table_schema = %s AND table_name = %s"
        " ORDER BY ordinal_position",
        (LEASE_SCHEMA, table),
    ).fetchall()
    return table, cols


def _filler_value(col: str, dtype: str) -> sql.Composable:
    by_name = {
        "name": sql.SQL("'bench:fill:' || g"),
        "holder": sql.SQL("'bench-filler'"),
        "expires_at": sql.SQL("clock_timestamp() + interval '1 day'"),
    }
    if col in by_name:
        return by_name[col]
    if dtype in ("text", "character varying", "character"):
        return sql.SQL("'bench-filler'")
    if dtype in ("bigint", "integer", "smallint", "numeric"):
        return sql.SQL("g")
    if dtype in ("double precision", "real"):
        return sql.SQL("30")
    if dtype.startswith("timestamp"):
        return sql.SQL("clock_timestamp()")
    if dtype in ("json", "jsonb"):
        return sql.SQL("'{}'")
    if dtype == "boolean":
        return sql.SQL("false")
    if dtype == "uuid":
        return sql.SQL("gen_random_uuid()")
    if dtype == "interval":
        return sql.SQL("interval '30 seconds'")
    raise RuntimeError(f"no filler value for column {col} of type {dtype}")


def fill_lease_table(conn: psycopg.Connection[Any], rows: int) -> None:
    """Bulk-insert ``rows`` live leases held by a filler, then ANALYZE."""
    table, cols = _lease_table(conn)
    names, values = [], []
    for col, dtype, not_null, has_default in cols:
        if col in ("name", "holder", "expires_at") or (not_null and not has_default):
            names.append(sql.Identifier(col))
            values.append(_filler_value(col, dtype))
    conn.execute(
        sql.SQL("INSERT INTO {}.{} ({}) SELECT {} FROM generate_series(1, {}) AS g").format(
            sql.Identifier(LEASE_SCHEMA),
            sql.Identifier(table),
            sql.SQL(", ").join(names),
            sql.SQL(", ").join(values),
            sql.Literal(rows),
        )
    )
    conn.execute(
        sql.SQL("ANALYZE {}.{}").format(sql.Identifier(LEASE_SCHEMA), sql.Identifier(table))
    )


@contextlib.contextmanager
def _sized_database(ctx: Context, rows: int) -> Iterator[str]:
    with scratch_database(ctx.dsn, ctx.app_name, prefix="pglock_bench_rows") as db:
        dsn = dsn_with_db(ctx.dsn, db)
        err = install_schema(dsn)
        if err:
            raise RuntimeError(err)
        with psycopg.connect(dsn, autocommit=True, application_name=ctx.app_name) as c:
            fill_lease_table(c, rows)
        yield dsn


def acquire_vs_rows(ctx: Context) -> dict[str, Any]:
    """Lease acquire latency on fresh names, alternating blocks between a database whose lease
    table holds ``rows_small`` rows and one holding ``rows_large``."""
    s = ctx.settings
    sizes = {"small": s.rows_small, "large": s.rows_large}
    lat: dict[str, list[float]] = {k: [] for k in sizes}
    with contextlib.ExitStack() as stack:
        pools = {}
        for key, rows in sizes.items():
            t0 = time.perf_counter()
            dsn = stack.enter_context(_sized_database(ctx, rows))
            pools[key] = stack.enter_context(make_pool(ctx, dsn))
            print(f"  E: {rows:,} rows ready in {time.perf_counter() - t0:.1f} s", flush=True)
        for key, pool in pools.items():  # warm up both
            with _pglock.lease(pool, f"bench:E:warm:{key}", ttl=30):
                pass
        for b in range(s.acquire_blocks):
            for key in list(sizes) if b % 2 == 0 else list(sizes)[::-1]:
                for j in range(s.acquires_per_block):
                    lease = _pglock.lease(pools[key], f"bench:E:rows:{b}:{j}", ttl=30)
                    t = time.perf_counter_ns()
                    lease.__enter__()
                    lat[key].append((time.perf_counter_ns() - t) / 1000.0)
                    lease.__exit__(None, None, None)
    small, large = median(lat["small"]), median(lat["large"])
    return {
        "rows_small": s.rows_small,
        "rows_large": s.rows_large,
        "small_p50_us": rnd(small, 1),
        "small_p99_us": rnd(percentile(lat["small"], 99), 1),
        "large_p50_us": rnd(large, 1),
        "large_p99_us": rnd(percentile(lat["large"], 99), 1),
        "ratio": rnd(large / small, 3),
        "samples": len(lat["small"]),
    }


def workload_e(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part, fn in (("keepalive", keepalive), ("acquire_vs_rows", acquire_vs_rows)):
        try:
            out[part] = fn(ctx)
        except Exception as exc:
            out[part] = {"errors": [repr(exc)]}
            ctx.note(f"E/{part} failed: {exc!r}")
    return out


# --- F: many waiters on one lease ---------------------------------------------------------------


def workload_f(ctx: Context) -> dict[str, Any]:
    """F in one process (waiters queue locally) and spread over processes."""
    out: dict[str, Any] = {}
    parts: list[tuple[str, Callable[[Context], dict[str, Any]]]] = [
        ("one_process", crowd_one_process), ("processes", crowd_cross_process)
    ]
    if ctx.waiter_pglock is not None:
        out["waiter_pglock"] = ctx.waiter_pglock
        parts.append(("processes_waiter_pglock",
                      partial(crowd_cross_process, pglock_dir=ctx.waiter_pglock)))
    for part, fn in parts:
        try:
            out[part] = fn(ctx)
        except Exception as exc:
            out[part] = {"errors": [repr(exc)]}
            ctx.note(f"F/{part} failed: {exc!r}")
    return out


def crowd_one_process(ctx: Context) -> dict[str, Any]:
    """``settings.waiters`` threads block on one lease held by this thread; the holder releases
    and the lease passes from waiter to waiter. Statements per handoff = every round trip the
    process sends from the first release to the last release, divided by the handoffs."""
    s = ctx.settings
    name = ctx.lock_name("F", "lease")
    pool = make_pool(ctx, max_size=10)
    got: list[float] = []
    errors: list[str] = []
    entered = threading.Barrier(s.waiters + 1, timeout=60)
    try:
        holder = _pglock.lease(pool, name, ttl=30)
        holder.__enter__()

        def waiter() -> None:
            try:
                entered.wait()
                with _pglock.lease(pool, name, ttl=30, timeout=120):
                    got.append(time.perf_counter())
            except Exception as exc:
                errors.append(repr(exc))

        with StatementCounter() as counter:
            threads = [
                threading.Thread(target=waiter, name=f"bench-F-{i}", daemon=True)
                for i in range(s.waiters)
            ]
            for t in threads:
                t.start()
            entered.wait()
            # Every waiter has called pglock.lease; wait until the process has gone quiet.
            quiet_since, last = time.monotonic(), counter.total
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                time.sleep(0.02)
                if counter.total != last:
                    quiet_since, last = time.monotonic(), counter.total
                elif time.monotonic() - quiet_since >= 0.3:
                    break
            waiting = counter.total
            start = counter.total
            t0 = time.perf_counter()
            holder.__exit__(None, None, None)
            for t in threads:
                t.join(timeout=150)
            elapsed = time.perf_counter() - t0
            statements = counter.total - start
    finally:
        pool.close()
    handoffs = len(got)
    return {
        "waiters": s.waiters,
        "handoffs": handoffs,
        "statements": statements,
        "statements_before_release": waiting,
        "statements_per_handoff": rnd(statements / handoffs, 2) if handoffs else None,
        "seconds": rnd(elapsed, 3),
        "handoffs_per_s": rnd(handoffs / elapsed, 1) if elapsed > 0 else None,
        **({"errors": errors} if errors else {}),
    }


# --- waiters in other processes (C and F) ---------------------------------------------------------


#: A waiter process on the pglock package of another directory (--waiter-pglock): that
#: directory goes first on sys.path, before the repository root (the working directory).
_ON_PGLOCK = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module('benchmarks._lease_waiter', run_name='__main__', alter_sys=True)"
)


class _Child:
    """A ``benchmarks._lease_waiter`` process, with line reads that time out; on the pglock
    package in ``pglock_dir`` when given."""

    def __init__(self, ctx: Context, *args: str, pglock_dir: str | None = None) -> None:
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        start = ["-m", "benchmarks._lease_waiter"] if pglock_dir is None else [
            "-c", _ON_PGLOCK, pglock_dir]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                *start,
                *args,
                *("--dsn", ctx.scratch_dsn, "--app", ctx.app_name),
            ],
            cwd=Path(__file__).resolve().parents[1],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="bench-child-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def readline(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer from the lease waiter in {timeout} s") from None
        if line is None:
            raise RuntimeError(f"the lease waiter ended: {self.stderr()}")
        return line

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-500:]

    def end_input(self) -> None:
        """Close the child's stdin: it finishes and prints its report."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self, timeout: float = 30) -> None:
        with contextlib.suppress(Exception):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._err.close()


def handoff_cross_process(
    ctx: Context, rounds: int, *, durable: bool, pglock_dir: str | None = None
) -> dict[str, Any]:
    """C for leases with the waiter in another process (on the pglock in ``pglock_dir``, if
    given): this process holds and releases; the child, blocked in pglock.lease, reports the
    perf_counter time it got the lease."""
    name = ctx.lock_name("C", "lease-xproc")
    pool = make_pool(ctx)
    child = _Child(ctx, "handoff", "--name", name, *([] if durable else ["--nondurable"]),
                   pglock_dir=pglock_dir)
    ms: list[float] = []
    try:
        for r in range(rounds + 1):  # the first round warms the child up and is not counted
            lease = _pglock.lease(pool, name, ttl=30, durable=durable)
            lease.__enter__()
            try:
                child.send("go")
                if child.readline(60) != "waiting":
                    raise RuntimeError("unexpected answer from the lease waiter")
                time.sleep(random.uniform(0.03, 0.08))  # it tries once, then waits
                t0 = time.perf_counter()
            finally:
                lease.__exit__(None, None, None)
            t1 = float(child.readline(60))
            if r:
                ms.append((t1 - t0) * 1000)
    finally:
        child.close()
        pool.close()
    return {
        "handoffs": len(ms),
        "p50_ms": rnd(median(ms), 3),
        "p99_ms": rnd(percentile(ms, 99), 3),
        "mean_ms": rnd(sum(ms) / len(ms), 3) if ms else None,
    }


#: H1's waiter queue (revision 0004): a row per waiting lease, read here only to confirm that
#: each waiter has joined the queue before the next one starts (so arrival order is known).
QUEUE_TABLE = "lease_waiter"


def queue_probe(conn: psycopg.Connection[Any], name: str) -> Callable[[], int] | None:
    """A function counting the waiters queued on ``name`` (all waiters, if the queue table has
    no name column), or None while pglock has no waiter queue in the database."""
    row = conn.execute("SELECT to_regclass(%s)", (f"{LEASE_SCHEMA}.{QUEUE_TABLE}",)).fetchone()
    if not row or row[0] is None:
        return None
    cols = {
        r[0]
        for r in conn.execute(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = %s AND table_name = %s",
            (LEASE_SCHEMA, QUEUE_TABLE),
        )
    }
    table = sql.Identifier(LEASE_SCHEMA, QUEUE_TABLE)
    col = next((c for c in ("name", "lease_name") if c in cols), None)
    params: tuple[str, ...] = ()
    if col is None:
        query = sql.SQL("SELECT count(*) FROM {}").format(table)
    else:
        query = sql.SQL("SELECT count(*) FROM {} WHERE {} = %s").format(table, sql.Identifier(col))
        params = (name,)

    def count() -> int:
        got = conn.execute(query, params).fetchone()
        return int(got[0]) if got else 0

    return count


def _at_least(count: Callable[[], int], n: int) -> bool:
    return count() >= n


def _line_up(children: list[_Child], total: int, queued: Callable[[], int] | None) -> None:
    """Start waiter 0, 1, ... in turn, round-robin over the processes; with a queue table,
    each one must show up in it before the next starts. Without one, every process is left to
    go quiet (its waiters are all waiting) instead."""
    for i in range(total):
        child = children[i % len(children)]
        child.send(f"wait {i}")
        if child.readline(30) != f"started {i}":
            raise RuntimeError("unexpected answer from a lease waiter")
        if queued is not None and not wait_until(partial(_at_least, queued, i + 1), 10, 0.002):
            raise RuntimeError(f"waiter {i} never showed up in {LEASE_SCHEMA}.{QUEUE_TABLE}")
    if queued is None:
        for child in children:
            child.send("quiet")
        for child in children:
            if child.readline(60) != "quiet":
                raise RuntimeError("unexpected answer from a lease waiter")


def _grant_order(reports: list[dict[str, Any]], total: int, confirmed: bool) -> dict[str, Any]:
    """The waiters' IDs in the order of their fencing tokens (the database's grant order)
    against arrival order (0, 1, ...), which is only known when the queue confirmed it."""
    got = sorted((tok, ident) for r in reports for ident, tok, _ in r["got"] if tok is not None)
    order = [ident for _, ident in got]
    return {
        "arrival_confirmed": confirmed,
        "grant_order": order,
        "out_of_order": sum(1 for j, ident in enumerate(order) if ident != j),
        "grants_in_arrival_order": (order == list(range(total))) if confirmed else None,
    }


def crowd_cross_process(ctx: Context, pglock_dir: str | None = None) -> dict[str, Any]:
    """F with the waiters spread over ``waiter_procs`` processes (on the pglock in
    ``pglock_dir``, if given): only the database tells them of a release. The waiters start
    one at a time (round-robin over the processes), each confirmed waiting in pglock's queue
    table when there is one; statements = round trips every process sent from the release on;
    grant order = the waiters sorted by fencing token."""
    s = ctx.settings
    procs = max(1, s.waiter_procs)
    total = procs * max(1, s.waiters // procs)
    name = ctx.lock_name("F", "lease-xproc")
    pool = make_pool(ctx)
    children: list[_Child] = []
    try:
        holder = _pglock.lease(pool, name, ttl=30)
        holder.__enter__()
        try:
            children = [
                _Child(ctx, "line", "--name", name, pglock_dir=pglock_dir) for _ in range(procs)
            ]
            for c in children:
                if c.readline(90) != "ready":
                    raise RuntimeError("unexpected answer from a lease waiter")
            with ctx.connect() as monitor:
                queued = queue_probe(monitor, name)
                _line_up(children, total, queued)
        finally:
            with StatementCounter() as mine:
                t0 = time.perf_counter()
                holder.__exit__(None, None, None)
        for c in children:
            c.end_input()
        reports = [json.loads(c.readline(180)) for c in children]
        elapsed = max((t for r in reports for _, _, t in r["got"]), default=t0) - t0
    finally:
        for c in children:
            c.close()
        pool.close()
    handoffs = sum(len(r["got"]) for r in reports)
    statements = mine.total + sum(1 for r in reports for t in r["stamps"] if t >= t0)
    errors = [e for r in reports for e in r["errors"]]
    return {
        "waiters": total,
        "processes": procs,
        "handoffs": handoffs,
        "statements": statements,
        "statements_per_handoff": rnd(statements / handoffs, 2) if handoffs else None,
        "seconds": rnd(elapsed, 3),
        "arrival_check": f"{LEASE_SCHEMA}.{QUEUE_TABLE}" if queued else None,
        "waiters_pglock": sorted({str(r.get("pglock")) for r in reports}),
        **_grant_order(reports, total, queued is not None),
        **({"errors": errors} if errors else {}),
    }
