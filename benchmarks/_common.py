"""Shared pieces of the benchmark harness: settings, the scratch database, statistics, counters.

Nothing here measures anything by itself; the workloads live in ``_workloads.py`` (A-D),
``_leases.py`` (E, F) and ``_pools.py`` (G).
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import tempfile
import threading
import time
import types
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

APP_NAME = "pglock-bench"


@dataclass(frozen=True)
class Settings:
    """How much work each workload does. ``full()`` is the documented run; ``quick()`` is the
    smoke run CI uses (it checks that the harness works, its numbers mean nothing)."""

    quick: bool
    # A and G: alternating blocks of cycles
    blocks: int
    cycles_per_block: int
    # B and D: threads, seconds per measurement, repetitions (alternated between adapters)
    threads: int
    seconds: float
    reps: int
    # C: handoffs per adapter (push-based waits, and the slower polling peers)
    handoffs: int
    handoffs_polled: int
    # E: leases held, measuring window, their ttl; lease-table sizes; acquire samples
    leases: int
    keepalive_window: float
    keepalive_ttl: float
    rows_small: int
    rows_large: int
    acquire_blocks: int
    acquires_per_block: int
    # F: waiters on one lease (in this process; and spread over that many processes)
    waiters: int
    waiter_procs: int
    # H: cycles per contender whose WAL flushes are counted
    wal_cycles: int

    @classmethod
    def full(cls) -> Settings:
        return cls(
            quick=False,
            blocks=60,
            cycles_per_block=50,
            threads=8,
            seconds=1.5,
            reps=3,
            handoffs=50,
            handoffs_polled=25,
            leases=10_000,
            keepalive_window=21.0,  # two renewal rounds at the default ttl
            keepalive_ttl=30.0,  # pglock.lease's default
            rows_small=1_000,
            rows_large=1_000_000,
            acquire_blocks=10,
            acquires_per_block=50,
            waiters=50,
            waiter_procs=10,
            wal_cycles=500,
        )

    @classmethod
    def quick_(cls) -> Settings:
        return cls(
            quick=True,
            blocks=2,
            cycles_per_block=8,
            threads=3,
            seconds=0.15,
            reps=1,
            handoffs=3,
            handoffs_polled=2,
            leases=50,
            keepalive_window=1.5,
            keepalive_ttl=1.5,
            rows_small=100,
            rows_large=2_000,
            acquire_blocks=2,
            acquires_per_block=5,
            waiters=4,
            waiter_procs=2,
            wal_cycles=30,
        )


@dataclass
class Context:
    """Where the benchmark runs: the servers, the scratch database, the session name."""

    dsn: str  # what the user gave (its database is only used to create the scratch one)
    scratch_dsn: str
    scratch_db: str
    redis_url: str | None
    app_name: str
    settings: Settings
    redis_skip: str | None = None  # why the Redis peers are skipped, if they are
    notes: list[str] = field(default_factory=list)
    pin_cpu: int | None = None  # --pin-cpu: A's and G's client and backends on this CPU
    #: --waiter-pglock: C and F also run their waiter processes on the pglock package here
    waiter_pglock: str | None = None

    def connect(
        self, *, autocommit: bool = True, dsn: str | None = None
    ) -> psycopg.Connection[Any]:
        """A new connection to the scratch database carrying the benchmark's application_name."""
        return psycopg.connect(
            dsn or self.scratch_dsn, autocommit=autocommit, application_name=self.app_name
        )

    def note(self, text: str) -> None:
        print(f"  note: {text}", flush=True)
        self.notes.append(text)

    def lock_name(self, workload: str, adapter: str) -> str:
        return f"bench:{workload}:{adapter}:{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def pinned(ctx: Context) -> Iterator[dict[str, Any] | None]:
    """Run the body with the calling thread (the one that runs the cycles) and the server
    backends of the run's sessions (those with its application_name in the scratch database,
    connected by now) on ``ctx.pin_cpu``, or as they are when that is None. Yields what was
    pinned, for the results.

    Why: on a small virtual machine a round trip between a client and a backend on different
    CPUs costs a cross-CPU wakeup each way; on this 2-CPU machine a raw lock/unlock cycle took
    45 µs with both on one CPU and about 150 µs on two, and the scheduler moves backends
    between the two during a run, so two sessions sending the same statements differed by 3x.
    Pinning needs the server on this machine and the right to set its processes' affinity
    (root, or the server's user); if a backend cannot be pinned, nothing is and the run says so.
    """
    if ctx.pin_cpu is None:
        yield None
        return
    cpu = ctx.pin_cpu
    with ctx.connect() as c:
        pids = [
            r[0]
            for r in c.execute(
                "SELECT pid FROM pg_stat_activity"
                " WHERE application_name = %s AND datname = %s AND pid <> pg_backend_pid()",
                (ctx.app_name, ctx.scratch_db),
            )
        ]
    mine = os.sched_getaffinity(0)
    theirs: dict[int, set[int]] = {}
    try:
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"postgres" not in f.read():
                    raise OSError(f"process {pid} here is not a postgres backend")
            theirs[pid] = os.sched_getaffinity(pid)
            os.sched_setaffinity(pid, {cpu})
        os.sched_setaffinity(0, {cpu})
    except OSError as exc:
        for pid, cpus in theirs.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(pid, cpus)
        ctx.note(f"--pin-cpu {cpu}: nothing pinned (the server must run here): {exc}")
        yield {"cpu": cpu, "pinned": False, "error": str(exc)}
        return
    try:
        yield {"cpu": cpu, "pinned": True, "backends": len(pids)}
    finally:
        os.sched_setaffinity(0, mine)
        for pid, cpus in theirs.items():
            with contextlib.suppress(OSError):  # the backend may be gone
                os.sched_setaffinity(pid, cpus)


def dsn_with_db(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo("", **params)


@contextlib.contextmanager
def scratch_database(dsn: str, app_name: str, prefix: str = "pglock_bench") -> Iterator[str]:
    """Create a throwaway database (from template0, so nobody else's sessions are in the way)
    and drop it afterwards. Yields its name."""
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(dsn, autocommit=True, application_name=app_name) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(dsn, autocommit=True, application_name=app_name) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


# --- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; values need not be sorted."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dig(d: Any, *path: str) -> Any:
    """``d[path[0]][path[1]]...`` through nested dicts of results; None where a step is missing."""
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rnd(x: float, digits: int = 3) -> float | None:
    """Round for JSON; NaN becomes None."""
    if x != x:  # NaN
        return None
    return round(x, digits)


# --- counting what reaches the server -------------------------------------------------------


class StatementCounter:
    """Counts the round trips psycopg sends, per thread, while active.

    It wraps the cursor's execute generator (what ``Cursor.execute`` runs, and what a caller
    that drives psycopg's generators itself runs, as pglock's cancellable statements do),
    ``executemany`` and the connection's internal command path (``BEGIN``, ``COMMIT``,
    ``ROLLBACK``, savepoints): one call is one round trip to the server, whatever the connection
    (the caller's, a pool's, one that a library opened itself). A ``;``-joined batch counts
    once, as it travels once. Only for counting passes: the wrappers cost a little time, so
    timed passes never run under it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_thread: Counter[str] = Counter()
        self._stamps: list[float] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _bump(self) -> None:
        name = threading.current_thread().name
        now = time.perf_counter()
        with self._lock:
            self.by_thread[name] += 1
            self._stamps.append(now)

    def stamps(self) -> list[float]:
        """perf_counter() times of every round trip counted so far."""
        with self._lock:
            return list(self._stamps)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.by_thread.values())

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.by_thread)

    def __enter__(self) -> StatementCounter:
        from psycopg import _connection_base, _cursor_base

        bump = self._bump

        def wrap(owner: Any, attr: str) -> None:
            orig = owner.__dict__[attr]

            def counted(*args: Any, **kwargs: Any) -> Any:
                bump()
                return orig(*args, **kwargs)

            counted.__wrapped__ = orig  # type: ignore[attr-defined]
            self._saved.append((owner, attr, orig))
            setattr(owner, attr, counted)

        wrap(_cursor_base.BaseCursor, "_execute_gen")
        wrap(psycopg.Cursor, "executemany")
        wrap(_connection_base.BaseConnection, "_exec_command")
        # pglock's statements sent straight through libpq (pglock._conn) run psycopg's execute
        # generator by itself: counted at pglock's own reference to psycopg's generators.
        from pglock import _conn

        generators = getattr(_conn, "generators")  # noqa: B009 (a module pglock imported)
        counted = types.SimpleNamespace(**vars(generators))
        orig_execute = generators.execute

        def execute(*args: Any, **kwargs: Any) -> Any:
            bump()
            return orig_execute(*args, **kwargs)

        counted.execute = execute
        self._saved.append((_conn, "generators", generators))
        setattr(_conn, "generators", counted)  # noqa: B010
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, orig in reversed(self._saved):
            setattr(owner, attr, orig)
        self._saved.clear()


_READY = re.compile(rb"^B\t\d+\tReadyForQuery", re.MULTILINE)


@contextlib.contextmanager
def trace_round_trips(conns: Sequence[psycopg.Connection[Any]]) -> Iterator[Callable[[], int]]:
    """libpq's protocol trace on ``conns``; yields a function that returns the round trips
    (ReadyForQuery messages) seen so far. Exact, and independent of how psycopg is driven."""
    files = []
    for c in conns:
        f = tempfile.TemporaryFile()  # noqa: SIM115 (closed below, after untrace)
        c.pgconn.trace(f.fileno())
        c.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        files.append((c, f))
    total: list[int] = []

    def count() -> int:
        if not total:
            raise RuntimeError("round trips are counted after the block ends")
        return total[0]

    try:
        yield count
    finally:
        n = 0
        for c, f in files:
            with contextlib.suppress(Exception):
                c.pgconn.untrace()
            f.seek(0)
            n += len(_READY.findall(f.read()))
            f.close()
        total.append(n)


def thread_cpu_seconds(threads: Sequence[threading.Thread]) -> dict[str, float]:
    """CPU seconds (user + system) each of ``threads`` has used so far (threads that ended or
    whose clock cannot be read are left out)."""
    out: dict[str, float] = {}
    for t in threads:
        if t.ident is None or not t.is_alive():
            continue
        try:
            clock = time.pthread_getcpuclockid(t.ident)
            out[f"{t.name}#{t.ident}"] = time.clock_gettime(clock)
        except (OSError, AttributeError):
            continue
    return out


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.0005) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` seconds pass; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
