"""A lease waiter in its own process, driven by the benchmark over stdin/stdout.

Leases waiting in one process queue up locally; waiters in other processes only learn of a
release from the database (NOTIFY, expiry, fallback poll). This child lets workloads C and F
measure that distributed case. Times are ``time.perf_counter()``, which is CLOCK_MONOTONIC on
Linux and so comparable between processes of one machine.

    python -m benchmarks._lease_waiter handoff --dsn DSN --name NAME --app APP [--nondurable]
        for every "go" line on stdin: print "waiting", acquire (blocking), print the time it
        got the lease, release. Ends at EOF.
    python -m benchmarks._lease_waiter crowd --dsn DSN --name NAME --app APP --threads K
        K threads each wait for the lease once; prints "ready" when all of them have called
        pglock.lease and the process has gone quiet, then at the end one JSON line with the
        acquisition times and the times of every round trip the process sent.
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


def crowd(args: argparse.Namespace) -> None:
    pool = _pool(args.dsn, args.app, 4)
    got: list[float] = []
    errors: list[str] = []
    entered = threading.Barrier(args.threads + 1, timeout=60)

    def waiter() -> None:
        try:
            entered.wait()
            with _pglock.lease(pool, args.name, ttl=30, timeout=120):
                got.append(time.perf_counter())
        except Exception as exc:
            errors.append(repr(exc))

    try:
        with StatementCounter() as counter:
            threads = [
                threading.Thread(target=waiter, name=f"bench-F-child-{i}", daemon=True)
                for i in range(args.threads)
            ]
            for t in threads:
                t.start()
            entered.wait()
            quiet_since, last = time.monotonic(), counter.total
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # gone quiet: every waiter is waiting
                time.sleep(0.02)
                if counter.total != last:
                    quiet_since, last = time.monotonic(), counter.total
                elif time.monotonic() - quiet_since >= 0.3:
                    break
            print("ready", flush=True)
            for t in threads:
                t.join(timeout=150)
            stamps = counter.stamps()
    finally:
        pool.close()
    print(json.dumps({"got": got, "stamps": stamps, "errors": errors}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks._lease_waiter")
    p.add_argument("mode", choices=["handoff", "crowd"])
    p.add_argument("--dsn", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--app", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--nondurable", action="store_true")
    args = p.parse_args()
    (handoff if args.mode == "handoff" else crowd)(args)


if __name__ == "__main__":
    main()
