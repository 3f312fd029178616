"""pglock benchmarks: one command, one run, the same servers for every contender.

    python -m benchmarks.run                 # the full run (about 4-5 minutes)
    python -m benchmarks.run --quick         # tiny counts: checks the harness works (CI)
    python -m benchmarks.run --workloads A,C --adapters raw,pglock,pals

It creates a throwaway database on the server of ``--dsn`` (dropped at the end), measures the
workloads A-H (see benchmarks/README.md), prints an environment line and the medians with
ratios against the raw psycopg floor measured in the same run, checks the targets of issues 7
and 13, and saves ``<out>/YYYY-MM-DD.json`` and ``<out>/chart.png`` (``-quick`` suffixes for
--quick, ``-TAG`` for --tag).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

import pglock

from . import _adapters, _leases, _pools, _targets, _wal, _workloads
from ._adapters import Adapter
from ._common import APP_NAME, Context, Settings, dig, dsn_with_db, scratch_database

WORKLOADS = "ABCDEFGH"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
RESULTS = Path(__file__).resolve().parent / "results"
#: The figures "nothing else gets slower" (issue 13) compares with: the last full run before it.
BASELINE = RESULTS / "2026-11-26.json"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Benchmark pglock against raw psycopg and peer lock libraries.",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny counts (smoke run; numbers mean nothing)"
    )
    p.add_argument(
        "--workloads",
        default=WORKLOADS,
        help="which workloads, e.g. A,C (default: all of A-H; E-H need leases and pools)",
    )
    p.add_argument(
        "--adapters",
        default=None,
        help="only these adapters for A-D, comma-separated keys (raw is always included)",
    )
    p.add_argument(
        "--dsn",
        default=os.environ.get("PGLOCK_BENCH_DSN")
        or os.environ.get("PGLOCK_TEST_DSN")
        or DEFAULT_DSN,
        help="a Postgres server where a throwaway database may be created "
        "(default: $PGLOCK_BENCH_DSN, $PGLOCK_TEST_DSN or %(default)s)",
    )
    p.add_argument(
        "--redis",
        default=os.environ.get("PGLOCK_BENCH_REDIS", DEFAULT_REDIS),
        help="Redis URL for the Redis peers, or 'none' to skip them (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="where JSON and chart go")
    p.add_argument("--application-name", default=APP_NAME, help="application_name of every session")
    p.add_argument("--no-chart", action="store_true", help="do not draw the PNG chart")
    p.add_argument(
        "--baseline",
        type=Path,
        default=BASELINE,
        help="an earlier result JSON for issue 13's 'nothing else slower' (default: %(default)s)",
    )
    p.add_argument(
        "--tag", default="", help="suffix of the result files: YYYY-MM-DD-TAG.json and .md"
    )
    p.add_argument(
        "--pin-cpu",
        type=int,
        default=None,
        metavar="CPU",
        help="run workloads A and G with the benchmark thread and their Postgres backends on "
        "one CPU (Linux, server on this machine, root or the server's user): removes the "
        "cross-CPU wakeups that make one session 3x slower than another on a small VM",
    )
    p.add_argument(
        "--waiter-pglock",
        default=None,
        metavar="DIR",
        help="C and F also measure the cross-process lease handoff with the waiter processes "
        "importing the pglock package in DIR (DIR/pglock/, e.g. an earlier commit's), beside "
        "this one's: its cost side by side in one run",
    )
    args = p.parse_args(argv)
    if args.waiter_pglock is not None:
        args.waiter_pglock = str(Path(args.waiter_pglock).resolve())
        if not (Path(args.waiter_pglock) / "pglock" / "__init__.py").is_file():
            p.error(f"--waiter-pglock {args.waiter_pglock}: no pglock package in it")
    wl = {ch for ch in args.workloads.upper() if ch not in ", "}
    bad = wl - set(WORKLOADS)
    if bad:
        p.error(f"unknown workload(s) {sorted(bad)}; choose from {','.join(WORKLOADS)}")
    args.workloads = "".join(w for w in WORKLOADS if w in wl)
    if args.pin_cpu is not None:
        if not hasattr(os, "sched_setaffinity"):
            p.error("--pin-cpu needs Linux (os.sched_setaffinity)")
        if args.pin_cpu not in os.sched_getaffinity(0):
            p.error(f"--pin-cpu {args.pin_cpu}: this process may run on CPUs "
                    f"{sorted(os.sched_getaffinity(0))} only")
    return args


# --- environment -----------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(dsn: str, redis_url: str | None, app_name: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True, application_name=app_name) as c:
        row = c.execute(
            "SELECT current_setting('server_version'), current_setting('synchronous_commit'),"
            " current_setting('fsync')"
        ).fetchone()
        assert row is not None
        server, sync_commit, fsync = row
    redis_version: str | None = None
    redis_error: str | None = None
    if redis_url:
        try:
            import redis

            r = redis.Redis.from_url(redis_url, socket_connect_timeout=3, client_name=app_name)
            try:
                redis_version = str(r.info("server")["redis_version"])
            finally:
                r.close()
        except Exception as exc:
            redis_error = repr(exc)
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {
        "pglock": pglock.__version__,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "psycopg": psycopg.__version__,
        "psycopg_impl": psycopg.pq.__impl__,
        "libpq": psycopg.pq.version(),
        "postgres": server,
        "synchronous_commit": sync_commit,
        "fsync": fsync,
        "redis": redis_version,
        "redis_error": redis_error,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_1min_at_start": load,
        "peers": {
            d: _version(d)
            for d in (
                "pals",
                "postgresql-lock",
                "redis",
                "python-redis-lock",
                "pottery",
                "SQLAlchemy",
                "psycopg-pool",
            )
        },
    }


def environment_line(env: dict[str, Any]) -> str:
    libpq = env["libpq"]
    return (
        f"pglock {env['pglock']} | Python {env['python']} ({env['python_implementation']}) | "
        f"psycopg {env['psycopg']} ({env['psycopg_impl']}, libpq {libpq // 10000}.{libpq % 100}) | "
        f"PostgreSQL {env['postgres'].split()[0]} "
        f"(synchronous_commit={env['synchronous_commit']}) | "
        f"Redis {env['redis'] or 'n/a'} | {env['cpus']} CPUs | "
        f"load {env['load_1min_at_start']}"
    )


# --- targets of issue 7 ----------------------------------------------------------------------


def evaluate_targets(w: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of issue 7: met / not met / not yet measurable, with the true number."""
    out: list[dict[str, Any]] = []

    def add(tid: str, text: str, value: Any, ok: bool | None, shown: str) -> None:
        status = "not yet measurable" if ok is None else ("met" if ok else "not met")
        out.append({"id": tid, "target": text, "status": status, "value": value, "shown": shown})

    r = dig(w, "A", "adapters", "pglock", "ratio")
    cpu = dig(w, "A", "adapters", "pglock", "cpu_ratio")
    add(
        "pg_lock",
        "pg_lock cycle <= 1.1x raw psycopg cycle (alternating)",
        r,
        None if r is None else r <= 1.1,
        f"{r}x (median of per-round ratios "
        f"{(dig(w, 'A', 'adapters', 'pglock', 'ratio_blocks') or [None] * 3)[1]}x; "
        f"client CPU {cpu}x)"
        if r
        else "n/a",
    )

    x = dig(w, "A", "xact") or {}
    if "pglock_lock_round_trips" in x:
        ok = x["pglock_lock_round_trips"] == 1 and (
            x["pglock_commit_round_trips"] == x["raw_commit_round_trips"]
        )
        shown = (
            f"lock {x['pglock_lock_round_trips']} round trip, COMMIT "
            f"{x['pglock_commit_round_trips']} (raw: {x['raw_lock_round_trips']}, "
            f"{x['raw_commit_round_trips']}); cycle {x.get('ratio_vs_raw_xact')}x raw xact cycle"
        )
        add("xact_lock", "xact_lock adds one round trip and nothing at commit", x, ok, shown)
    else:
        add("xact_lock", "xact_lock adds one round trip and nothing at commit", None, None, "n/a")

    m = dig(w, "A", "multi_key_ratio")
    raw10 = dig(w, "A", "adapters", "raw-10", "ratio")
    add(
        "multi_key",
        "10-name pg_lock cycle <= 1.5x single-name cycle",
        m,
        None if m is None else m <= 1.5,
        f"{m}x (the raw 10-name statement costs {raw10}x the raw single one; pglock 10 names "
        f"= {dig(w, 'A', 'multi_key_vs_raw_multi')}x raw 10 names)"
        if m
        else "n/a",
    )

    lr = dig(w, "A", "adapters", "lease", "ratio")
    add(
        "lease_cycle",
        "lease cycle <= 2x raw advisory cycle (durable commits)",
        lr,
        None if lr is None else lr <= 2.0,
        f"{lr}x" if lr else "n/a",
    )
    nd = dig(w, "A", "adapters", "lease-nondurable", "ratio")
    add(
        "lease_cycle_nondurable",
        "non-durable lease cycle <= 1.25x raw (if offered)",
        nd,
        None if nd is None else nd <= 1.25,
        f"{nd}x" if nd else "n/a (no such mode yet)",
    )

    c = dig(w, "C", "adapters") or {}
    native = dig(c, "raw", "p50_ms")
    pollers = [v for v in (dig(c, "ttl-table", "p50_ms"), dig(c, "redis-py", "p50_ms")) if v]
    # The waiter in another process is the distributed case; the same-process one is local.
    for key, where in (("lease-xproc", "waiter in another process"), ("lease", "same process")):
        lease_h = dig(c, key, "p50_ms")
        if lease_h and native and pollers:
            vs_native, vs_poll = lease_h / native, min(pollers) / lease_h
            add(
                f"lease_handoff:{key}",
                f"lease handoff p50 ({where}) <= 2x native advisory handoff and >= 20x "
                "faster than 100 ms pollers",
                {"vs_native": round(vs_native, 2), "faster_than_pollers": round(vs_poll, 1)},
                vs_native <= 2 and vs_poll >= 20,
                f"{lease_h} ms = {vs_native:.2f}x native ({native} ms); {vs_poll:.1f}x faster "
                f"than the fastest 100 ms poller ({min(pollers)} ms)",
            )
        else:
            add(
                f"lease_handoff:{key}",
                f"lease handoff p50 ({where}) <= 2x native and >= 20x faster than pollers",
                None,
                None,
                "n/a",
            )

    k = dig(w, "E", "keepalive") or {}
    if k.get("statements_per_round") is not None:
        ok = k["statements_per_round"] <= 1.0 and k["keepalive_cpu_pct_of_core"] <= 5.0
        add(
            "keepalive",
            f"keepalive of {k['leases']:,} leases: 1 batched statement per round, <= 5% of a core",
            k,
            ok,
            f"{k['statements_per_round']} round trips/round ({k['statements_per_s']}/s at "
            f"ttl={k['ttl']} s), {k['keepalive_cpu_pct_of_core']}% of a core",
        )
    else:
        add(
            "keepalive",
            "keepalive: 1 batched statement per round, <= 5% of one core",
            None,
            None,
            "n/a",
        )

    rows = dig(w, "E", "acquire_vs_rows") or {}
    if rows.get("ratio") is not None:
        add(
            "rows",
            f"lease acquire at {rows['rows_large']:,} rows <= 1.2x at {rows['rows_small']:,} rows",
            rows["ratio"],
            rows["ratio"] <= 1.2,
            f"{rows['ratio']}x ({rows['large_p50_us']} vs {rows['small_p50_us']} µs)",
        )
    else:
        add("rows", "lease acquire at 1,000,000 rows <= 1.2x at 1,000 rows", None, None, "n/a")

    for part, where in (("processes", "over processes"), ("one_process", "in one process")):
        f = dig(w, "F", part) or {}
        if f.get("statements_per_handoff") is not None:
            add(
                f"handoff_statements:{part}",
                f"<= 3 statements per handoff with {f['waiters']} waiters ({where})",
                f["statements_per_handoff"],
                f["statements_per_handoff"] <= 3,
                f"{f['statements_per_handoff']} statements per handoff "
                f"({f['statements']} for {f['handoffs']} handoffs)",
            )
        else:
            add(
                f"handoff_statements:{part}",
                f"<= 3 statements per handoff with 50 waiters ({where})",
                None,
                None,
                "n/a",
            )

    g = dig(w, "G", "pool_lock_ratio")
    add(
        "pool_lock",
        "pool_lock cycle <= 1.1x checkout + raw lock cycle",
        g,
        None if g is None else g <= 1.1,
        f"{g}x" if g else "n/a",
    )
    return out


# --- printing ------------------------------------------------------------------------------


def _fmt(v: Any, suffix: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}{suffix}" if abs(v) < 100 else f"{v:,.0f}{suffix}"
    return f"{v}{suffix}"


def _where(w: dict[str, Any], tag: str) -> str:
    """What the workload's table header says of --pin-cpu."""
    pin = dig(w, tag, "pinned")
    if pin and pin.get("pinned"):
        return f"; the benchmark thread and its Postgres backends pinned to CPU {pin['cpu']}"
    return "; not pinned: a backend on another CPU than the client is slower (--pin-cpu)"


def _md_a(w: dict[str, Any]) -> list[str]:
    a = dig(w, "A", "adapters")
    if not a:
        return []
    lines = [
        "**A. Uncontended acquire+release** (each adapter in blocks adjacent to blocks of"
        f" the raw floor; ratio = p50 / p50 of those floor blocks{_where(w, 'A')})",
        "",
        "| adapter | p50 µs | p99 µs | cycles/s | ratio vs raw | per-round ratio min-med-max "
        "| client CPU µs/cycle | CPU ratio | round trips |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in a.values():
        if "error" in r:
            lines.append(f"| {r.get('label', '?')} | error: {r['error']} | | | | | | | |")
            continue
        rb = r.get("ratio_blocks") or [None] * 3
        lines.append(
            f"| {r['label']} | {_fmt(r['p50_us'])} | {_fmt(r['p99_us'])} | "
            f"{_fmt(r['cycles_per_s'])} | {_fmt(r['ratio'], 'x')} | "
            f"{_fmt(rb[0])}-{_fmt(rb[1])}-{_fmt(rb[2])} | {_fmt(r.get('cpu_us'))} | "
            f"{_fmt(r.get('cpu_ratio'), 'x')} | {_fmt(r.get('round_trips'))} |"
        )
    lines.append("")
    return lines


def _md_threads(w: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for tag, title in (("B", "B. {t} threads, distinct names"), ("D", "D. {t} threads, one name")):
        b = dig(w, tag, "adapters")
        if not b:
            continue
        lines += [
            f"**{title.format(t=w[tag]['threads'])}** (total cycles/s, median over repetitions;"
            " ratio vs raw paired by repetition)",
            "",
            "| adapter | cycles/s | ratio vs raw |" + (" lost updates |" if tag == "D" else ""),
            "|---|---:|---:|" + ("---:|" if tag == "D" else ""),
        ]
        for r in b.values():
            extra = f" {r.get('lost_updates')} |" if tag == "D" else ""
            err = " (errors)" if r.get("errors") else ""
            lines.append(
                f"| {r['label']}{err} | {_fmt(r['cycles_per_s'])} | {_fmt(r['ratio'], 'x')} |"
                + extra
            )
        lines.append("")
    return lines


def _md_c(w: dict[str, Any]) -> list[str]:
    c = dig(w, "C", "adapters")
    if not c:
        return []
    lines = [
        "**C. Handoff** (holder releases, blocked waiter acquires: release -> acquired)",
        "",
        "| adapter | p50 ms | p99 ms | handoffs | ratio vs raw |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in c.values():
        err = " (errors)" if r.get("errors") else ""
        lines.append(
            f"| {r['label']}{err} | {_fmt(r.get('p50_ms'))} | {_fmt(r.get('p99_ms'))} | "
            f"{r.get('handoffs', 0)} | {_fmt(r.get('ratio'), 'x')} |"
        )
    lines.append("")
    return lines


def _md_skipped(w: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for tag in "EFGH":
        v = w.get(tag)
        if isinstance(v, dict) and "skipped" in v:
            lines += [f"**{tag}** skipped: {v['skipped']}", ""]
    return lines


def _md_e(w: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    k = dig(w, "E", "keepalive")
    if k:
        lines += [
            f"**E. Keepalive** of {_fmt(k.get('leases'))} leases (ttl {k.get('ttl')} s) over "
            f"{k.get('window_s')} s: {_fmt(k.get('statements_per_s'))} round trips/s, "
            f"{_fmt(k.get('statements_per_round'))} per renewal round "
            f"({k.get('renewal_rounds')} rounds), keepalive thread "
            f"{_fmt(k.get('keepalive_cpu_pct_of_core'))}% of a core "
            f"({_fmt(k.get('keepalive_cpu_ms_per_round'))} ms CPU per round; whole process "
            f"{_fmt(k.get('process_cpu_pct_of_core'))}%), leases lost: {k.get('leases_lost')}; "
            f"acquiring them all took {k.get('acquire_all_s')} s"
            + (f" (errors: {k['errors']})" if k.get("errors") else ""),
            "",
        ]
    rows = dig(w, "E", "acquire_vs_rows")
    if rows:
        lines += [
            f"**E. Lease acquire** with {_fmt(rows.get('rows_small'))} vs "
            f"{_fmt(rows.get('rows_large'))} rows in the lease table (alternating blocks): "
            f"p50 {_fmt(rows.get('small_p50_us'))} vs {_fmt(rows.get('large_p50_us'))} µs, "
            f"ratio {_fmt(rows.get('ratio'), 'x')}"
            + (f" (errors: {rows['errors']})" if rows.get("errors") else ""),
            "",
        ]
    return lines


def _md_f(w: dict[str, Any]) -> list[str]:
    f = w.get("F") or {}
    if not ("one_process" in f or "processes" in f):
        return []
    other = f"processes on pglock at {f['waiter_pglock']}" if "waiter_pglock" in f else None
    lines = [
        "**F. Waiters on one lease** (statements = round trips sent from the first release"
        " to the last grant)",
        "",
        "| waiters | handoffs | statements | per handoff | seconds |",
        "|---|---:|---:|---:|---:|",
    ]
    parts = [("one_process", "in one process"), ("processes", "processes")]
    for part, where in parts + ([("processes_waiter_pglock", other)] if other else []):
        r = f.get(part) or {}
        who = (
            f"{r.get('waiters')} {where}"
            if part == "one_process"
            else f"{r.get('waiters')} in {r.get('processes')} {where}"
        )
        err = f" (errors: {r['errors']})" if r.get("errors") else ""
        lines.append(
            f"| {who}{err} | {r.get('handoffs')} | {r.get('statements')} | "
            f"{_fmt(r.get('statements_per_handoff'))} | {_fmt(r.get('seconds'))} |"
        )
    lines.append("")
    return lines


def _md_g(w: dict[str, Any]) -> list[str]:
    g = dig(w, "G", "cycles")
    if not g:
        return []
    lines = [
        f"**G. Pools** (pool of one connection; alternating blocks{_where(w, 'G')})",
        "",
        "| cycle | p50 µs | p99 µs | ratio vs checkout+raw | client CPU µs | round trips |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, r in g.items():
        lines.append(
            f"| {key} | {_fmt(r.get('p50_us'))} | {_fmt(r.get('p99_us'))} | "
            f"{_fmt(r.get('ratio'), 'x')} | {_fmt(r.get('cpu_us'))} | "
            f"{_fmt(r.get('round_trips'))} |"
        )
    lines.append("")
    return lines


def _md_pairs(w: dict[str, Any]) -> list[str]:
    rows = [
        (tag, x, y, v)
        for tag in "AG"
        for x, r in ((dig(w, tag, "adapters") or dig(w, tag, "cycles")) or {}).items()
        for y, v in (r.get("vs") or {}).items()
    ]
    if not rows:
        return []
    lines = [
        "**Direct pairs** (blocks of X next to blocks of Y in the same rounds, besides both next"
        " to the floor)",
        "",
        "| workload | X | Y | p50 ratio X/Y | per-round min-med-max | client CPU X - Y µs |",
        "|---|---|---|---:|---:|---:|",
    ]
    for tag, x, y, v in rows:
        rb = v.get("ratio_blocks") or [None] * 3
        lines.append(
            f"| {tag} | {x} | {y} | {_fmt(v.get('ratio'), 'x')} | "
            f"{_fmt(rb[0])}-{_fmt(rb[1])}-{_fmt(rb[2])} | {_fmt(v.get('cpu_diff_us'))} |"
        )
    lines.append("")
    return lines


def _md_h(w: dict[str, Any]) -> list[str]:
    h = dig(w, "H", "contenders")
    if not h:
        return []
    idle = dig(w, "H", "idle") or {}
    lines = [
        "**H. WAL flushes per cycle** (`pg_stat_wal.wal_sync` deltas on a private idle cluster, "
        f"PostgreSQL {dig(w, 'H', 'server')}; {idle.get('wal_sync')} flushes in "
        f"{idle.get('seconds')} s with nothing running)",
        "",
        "| contender | cycles | WAL flushes | per cycle | WAL writes per cycle |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, r in h.items():
        err = f" (errors: {r['errors']})" if r.get("errors") else ""
        lines.append(
            f"| {key}{err} | {r.get('cycles')} | {r.get('wal_sync')} | "
            f"{_fmt(r.get('flushes_per_cycle'))} | {_fmt(r.get('writes_per_cycle'))} |"
        )
    lines.append("")
    return lines


def _md_targets(targets: list[dict[str, Any]], issue: int = 7) -> list[str]:
    lines = [f"**Targets (issue {issue})**", "", "| target | status | measured |", "|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['target']} | {t['status']} | {t['shown']} |")
    lines.append("")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The tables of benchmarks/README.md for one result file."""
    w = result["workloads"]
    lines = [f"Run {result['date']}: `{result['command']}`", "", result["environment_line"], ""]
    for section in (_md_a, _md_pairs, _md_threads, _md_c, _md_skipped, _md_e, _md_f, _md_g, _md_h):
        lines += section(w)
    lines += _md_targets(result["targets_13"], 13)
    lines += _md_targets(result["targets"])
    return "\n".join(lines) + "\n"


# --- main --------------------------------------------------------------------------------------


def build_adapters(ctx: Context, only: set[str] | None, want_leases: bool) -> list[Adapter]:
    adapters = _adapters.advisory_adapters()
    if ctx.redis_url:
        adapters += _adapters.redis_adapters()
    if want_leases:
        adapters += _leases.lease_adapters()
    if only is not None:
        adapters = [a for a in adapters if a.key in only or a.key == "raw"]
    ready = []
    for a in adapters:
        try:
            a.setup(ctx)
            ready.append(a)
        except Exception as exc:
            ctx.note(f"{a.key} skipped: setup failed: {exc!r}")
    return ready


def _load_baseline(path: Path, notes: list[str]) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError) as exc:
        notes.append(f"no baseline for 'nothing else slower': {path}: {exc!r}")
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings.quick_() if args.quick else Settings.full()
    redis_url = None if args.redis.lower() == "none" else args.redis
    started = time.time()
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    env = environment(args.dsn, redis_url, args.application_name)
    print(environment_line(env), flush=True)
    notes: list[str] = []
    if redis_url and env["redis"] is None:
        notes.append(f"Redis peers skipped: {redis_url} does not answer ({env['redis_error']})")
        print(f"  note: {notes[-1]}", flush=True)
        redis_url = None
    workloads: dict[str, Any] = {}
    with scratch_database(args.dsn, args.application_name) as db:
        ctx = Context(
            dsn=args.dsn,
            scratch_dsn=dsn_with_db(args.dsn, db),
            scratch_db=db,
            redis_url=redis_url,
            app_name=args.application_name,
            settings=settings,
            notes=notes,
            pin_cpu=args.pin_cpu,
            waiter_pglock=args.waiter_pglock,
        )
        print(f"scratch database {db} (dropped at the end)", flush=True)
        lease_gap = _leases.missing()
        if lease_gap is None and any(w in args.workloads for w in "ABCDEF"):
            lease_gap = _leases.install_schema(ctx.scratch_dsn)
        if lease_gap:
            ctx.note(f"leases not measured: {lease_gap}")
        only = None if args.adapters is None else {a.strip() for a in args.adapters.split(",")}
        adapters = build_adapters(ctx, only, want_leases=lease_gap is None)
        print("adapters: " + ", ".join(a.key for a in adapters), flush=True)
        steps = {
            "A": lambda: _workloads.workload_a(ctx, adapters),
            "B": lambda: _workloads.workload_threads(ctx, adapters, same_name=False),
            "C": lambda: _workloads.workload_c(ctx, adapters),
            "D": lambda: _workloads.workload_threads(ctx, adapters, same_name=True),
            "E": lambda: _leases.workload_e(ctx),
            "F": lambda: _leases.workload_f(ctx),
            "G": lambda: _pools.workload_g(ctx),
            "H": lambda: _wal.workload_h(ctx),
        }
        gaps = {"E": lease_gap, "F": lease_gap, "G": _pools.missing()}
        gaps["H"] = lease_gap or _wal.missing()
        for tag in args.workloads:
            gap = gaps.get(tag)
            if gap:
                print(f"\n[{tag}] skipped: {gap}", flush=True)
                workloads[tag] = {"skipped": gap}
                continue
            print(f"\n[{tag}] running ...", flush=True)
            t0 = time.perf_counter()
            try:
                workloads[tag] = steps[tag]()
            except Exception as exc:
                workloads[tag] = {"errors": [repr(exc)]}
                ctx.note(f"workload {tag} failed: {exc!r}")
            workloads[tag]["elapsed_s"] = round(time.perf_counter() - t0, 1)
            print(f"[{tag}] done in {workloads[tag]['elapsed_s']} s", flush=True)
    result: dict[str, Any] = {
        "date": today,
        "started_at": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(),
        "duration_s": round(time.time() - started, 1),
        "command": "python -m benchmarks.run" + (" --quick" if args.quick else ""),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "quick": args.quick,
        "environment": env,
        "environment_line": environment_line(env),
        "settings": settings.__dict__,
        "scratch_database": db,
        "application_name": args.application_name,
        "workloads": workloads,
        "notes": notes,
    }
    result["targets"] = evaluate_targets(workloads)
    baseline = _load_baseline(args.baseline, notes)
    result["baseline"] = str(args.baseline) if baseline else None
    result["targets_13"] = _targets.evaluate(workloads, baseline)
    md = markdown(result)
    print("\n" + md, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = today + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(md)
    print(f"wrote {path}", flush=True)
    if not args.no_chart and importlib.util.find_spec("matplotlib") is None:
        print("no chart: matplotlib is not installed (pip install -e '.[bench]')", flush=True)
    elif not args.no_chart:
        from ._chart import draw

        chart = args.out / ("-".join(["chart", *stem.split("-")[3:]]) + ".png")
        draw(result, chart)
        print(f"wrote {chart}", flush=True)
    print(f"total {result['duration_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
