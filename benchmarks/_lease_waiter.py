"""A lease waiter in its own process, driven by the benchmark over stdin/stdout.

Leases waiting in one process queue up locally; waiters in other processes only learn of a
release from the database (NOTIFY, expiry, fallback poll). This child lets workloads C and F
measure that distributed case. Times are ``time.perf_counter()``, which is CLOCK_MONOTONIC on
Linux and so comparable between processes of one machine.

    python -m benchmarks._lease_waiter handoff --dsn DSN --name NAME --app APP [--nondurable]
        for every "go" line on stdin: print "waiting", acquire (blocking), print the time it
        got the lease, release. Ends at EOF.
    python -m benchmarks._lease_waiter line --dsn DSN --name NAME --app APP
        prints "ready"; for every "wait ID" line starts a thread that waits for the lease once
        and prints "started ID"; for "quiet" prints "quiet" once the process has sent nothing
        for 0.3 s; at EOF, when every waiter is done, one JSON line: per waiter its ID, the
        token it was granted and the time it got the lease, plus the times of every round
        trip the process sent and the pglock package it imported.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import pglock

from ._common import StatementCounter

_pglock: Any = pglock


def _pool(dsn: str, app: str, size: int) -> Any:
    from psycopg_pool import ConnectionPool

    return ConnectionPool(
        dsn,
        min_size=1,
        max_size=size,
        kwargs={"application_name": app},
        open=True,
        name="bench-lease-child",
    )


def handoff(args: argparse.Namespace) -> None:
    pool = _pool(args.dsn, args.app, 2)
    try:
        for line in sys.stdin:
            if line.strip() != "go":
                break
            print("waiting", flush=True)
            with _pglock.lease(pool, args.name, ttl=30, timeout=60, durable=not args.nondurable):
                print(repr(time.perf_counter()), flush=True)
    finally:
        pool.close()


def _until_quiet(counter: StatementCounter, quiet: float = 0.3, limit: float = 20.0) -> None:
    """Return once the process has sent nothing for ``quiet`` seconds (bounded)."""
    quiet_since, last = time.monotonic(), counter.total
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.02)
        if counter.total != last:
            quiet_since, last = time.monotonic(), counter.total
        elif time.monotonic() - quiet_since >= quiet:
            return


def line(args: argparse.Namespace) -> None:
    pool = _pool(args.dsn, args.app, 4)
    got: list[tuple[int, int | None, float]] = []
    errors: list[str] = []
    threads: list[threading.Thread] = []

    def waiter(ident: int) -> None:
        try:
            with _pglock.lease(pool, args.name, ttl=30, timeout=120) as lease:
                got.append((ident, lease.token, time.perf_counter()))
        except Exception as exc:
            errors.append(f"waiter {ident}: {exc!r}")

    try:
        with StatementCounter() as counter:
            print("ready", flush=True)
            for cmd in sys.stdin:
                word, _, arg = cmd.strip().partition(" ")
                if word == "wait":
                    t = threading.Thread(
                        target=waiter, args=(int(arg),), name=f"bench-F-{arg}", daemon=True
                    )
                    t.start()
                    threads.append(t)
                    print(f"started {arg}", flush=True)
                elif word == "quiet":
                    _until_quiet(counter)
                    print("quiet", flush=True)
            for t in threads:
                t.join(timeout=150)
            stamps = counter.stamps()
    finally:
        pool.close()
    report = {"got": got, "stamps": stamps, "errors": errors, "pglock": pglock.__file__}
    print(json.dumps(report), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks._lease_waiter")
    p.add_argument("mode", choices=["handoff", "line"])
    p.add_argument("--dsn", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--app", required=True)
    p.add_argument("--nondurable", action="store_true")
    args = p.parse_args()
    (handoff if args.mode == "handoff" else line)(args)


if __name__ == "__main__":
    main()
