"""Workload H: WAL flushes per lock cycle, counted by the server, never inferred from timing.

A durable commit waits for its WAL to reach disk: one ``fdatasync`` (``pg_stat_wal.wal_sync``,
PostgreSQL 14+). A lease cycle should cost exactly one (the grant; the release commits with
``synchronous_commit = off``), the naive TTL table two (insert and delete both commit durably),
a raw advisory cycle none (it writes no WAL).

``pg_stat_wal`` is cluster-wide, and the shared server is busy with other sessions, so H starts a
throwaway cluster of its own (``initdb`` into a temporary directory, a free loopback port,
``fsync`` and ``synchronous_commit`` on as by default, autovacuum off so nothing else writes).
A backend adds its WAL counters to the view only when it reports its statistics (when it goes
idle, at most once a second, else up to 10 s later, and at exit); ``pg_stat_force_next_flush()``
(PostgreSQL 15+) makes its next report immediate, at the end of that very statement. So every
reading is preceded by that call on each connection that ran cycles, and by a pause longer than
``wal_writer_delay`` (200 ms) so the WAL writer has flushed the asynchronous commits before it
and reported them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg

import pglock

from ._adapters import TTL_ACQUIRE, TTL_RELEASE, TTL_TABLE_DDL, sha256_key
from ._common import Context, rnd

_pglock: Any = pglock

SETTINGS = {
    "fsync": "on",
    "synchronous_commit": "on",
    "autovacuum": "off",
    "checkpoint_timeout": "'1h'",
    "max_wal_size": "'1GB'",
    "log_min_messages": "warning",
}


def _bindir() -> Path | None:
    env = os.environ.get("PGLOCK_PG_BINDIR")
    if env:
        return Path(env)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: int(n) if (n := Path(p).parent.parent.name).isdigit() else 0,
    )
    return Path(found[-1]).parent if found else None


def missing() -> str | None:
    """Why workload H cannot run (None when it can)."""
    if _bindir() is None:
        return "no Postgres binaries (initdb, pg_ctl) for a private cluster (PGLOCK_PG_BINDIR)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' OS user to run a private cluster"
    return None


@contextlib.contextmanager
def private_cluster() -> Iterator[str]:
    """A throwaway cluster on a free loopback port; yields its DSN, destroys it afterwards."""
    bindir = _bindir()
    assert bindir is not None
    user = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="pglock-bench-wal-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def run(*argv: str) -> None:
        cmd = ["runuser", "-u", user, "--", *argv] if user else list(argv)
        env = dict(os.environ, LC_ALL="C", LANG="C")
        subprocess.run(cmd, check=True, capture_output=True, timeout=120, env=env)

    data = root / "data"
    try:
        if user:
            shutil.chown(root, user)
        run(
            *(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"),
            *("-E", "UTF8", "--locale=C", "--no-sync"),
        )
        conf = {
            **SETTINGS,
            "listen_addresses": "'127.0.0.1'",
            "port": str(port),
            "unix_socket_directories": f"'{root}'",
        }
        with (data / "postgresql.conf").open("a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "start")
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        with contextlib.suppress(Exception):
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def _wal_counters(monitor: psycopg.Connection[Any]) -> tuple[int, int]:
    """(wal_sync, wal_write) now; autocommit, so every reading is a fresh stats snapshot."""
    row = monitor.execute("SELECT wal_sync, wal_write FROM pg_stat_wal").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _report_stats(conns: list[psycopg.Connection[Any]], settle: float) -> None:
    """Make every backend in ``conns`` report its counters now, then let the WAL writer flush
    and report what asynchronous commits left behind."""
    for c in conns:
        c.execute("SELECT pg_stat_force_next_flush()")
        if not c.autocommit:
            c.commit()
    time.sleep(settle)


def count_flushes(
    cycle: Callable[[], None],
    conns: list[psycopg.Connection[Any]],
    monitor: psycopg.Connection[Any],
    cycles: int,
    settle: float,
) -> dict[str, Any]:
    """WAL syncs and writes per call of ``cycle`` over ``cycles`` calls (after a warm-up)."""
    for _ in range(5):
        cycle()
    _report_stats(conns, settle)
    sync0, write0 = _wal_counters(monitor)
    t0 = time.perf_counter()
    for _ in range(cycles):
        cycle()
    elapsed = time.perf_counter() - t0
    _report_stats(conns, settle)
    sync1, write1 = _wal_counters(monitor)
    return {
        "cycles": cycles,
        "wal_sync": sync1 - sync0,
        "wal_write": write1 - write0,
        "flushes_per_cycle": rnd((sync1 - sync0) / cycles, 3),
        "writes_per_cycle": rnd((write1 - write0) / cycles, 3),
        "seconds": rnd(elapsed, 3),
    }


def _idle(monitor: psycopg.Connection[Any], seconds: float) -> dict[str, Any]:
    """WAL syncs of the private cluster while nothing runs: the background to expect."""
    s0, _ = _wal_counters(monitor)
    time.sleep(seconds)
    s1, _ = _wal_counters(monitor)
    return {"seconds": seconds, "wal_sync": s1 - s0}


def _lease_cycle(dsn: str, stack: contextlib.ExitStack, **options: Any) -> tuple[Any, list[Any]]:
    """A lease cycle on a pool of one connection (held here too, to report its stats)."""
    from psycopg_pool import ConnectionPool

    pool = stack.enter_context(
        ConnectionPool(dsn, min_size=1, max_size=1, open=True, name="bench-H")
    )
    name = f"bench:H:lease:{options.get('durable', True)}"

    def cycle() -> None:
        with _pglock.lease(pool, name, ttl=30, **options):
            pass

    class _PoolConn:
        """The pool's connection for :func:`_report_stats`, checked out only while used."""

        autocommit = True

        def execute(self, query: str) -> None:
            with pool.connection() as c:
                c.execute(query)

        def commit(self) -> None:
            pass

    return cycle, [_PoolConn()]


def workload_h(ctx: Context) -> dict[str, Any]:
    """Raw advisory, the naive TTL table and leases, each on a private idle cluster."""
    from ._leases import install_schema, lease_adapters

    s = ctx.settings
    settle = 0.2 if s.quick else 0.5
    out: dict[str, Any] = {"settings": {k: v.strip("'") for k, v in SETTINGS.items()}}
    with private_cluster() as dsn, contextlib.ExitStack() as stack:
        err = install_schema(dsn)
        if err:
            raise RuntimeError(err)
        monitor = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        row = monitor.execute("SHOW server_version").fetchone()
        out["server"] = row[0] if row else None
        conn = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        conn.execute(TTL_TABLE_DDL)
        key = sha256_key("bench:H:raw")

        def raw() -> None:
            conn.execute("SELECT pg_advisory_lock(%s)", (key,))
            conn.execute("SELECT pg_advisory_unlock(%s)", (key,))

        def ttl() -> None:
            conn.execute(TTL_ACQUIRE, ("bench:H:ttl", "bench-H", 30.0))
            conn.execute(TTL_RELEASE, ("bench:H:ttl", "bench-H"))

        out["idle"] = _idle(monitor, settle if s.quick else 2.0)
        contenders: dict[str, tuple[Callable[[], None], list[Any]]] = {
            "raw": (raw, [conn]),
            "ttl-table": (ttl, [conn]),
        }
        for a in lease_adapters():
            contenders[a.key] = _lease_cycle(dsn, stack, **getattr(a, "options", {}))
        res: dict[str, Any] = {}
        for who, (cycle, conns) in contenders.items():
            try:
                res[who] = count_flushes(cycle, conns, monitor, s.wal_cycles, settle)
            except Exception as exc:
                res[who] = {"errors": [repr(exc)]}
        out["contenders"] = res
    return out
