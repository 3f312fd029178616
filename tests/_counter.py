"""The lost-update oracle shared by the pool, SQLAlchemy and PgBouncer tests.

Each critical section reads a counter row on its own separate autocommit connection, sleeps a
random 0-3 ms and writes value+1 with a unique id appended (never an atomic increment, which row
locks would make correct without any advisory lock). With a working lock the counter equals the
number of acknowledged sections; the same workload without the lock must lose updates.
(tests/faults/oracles.py has the multi-process version.)
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from psycopg import sql


def run_counter(
    pg_dsn: str,
    app_name: str,
    section: Callable[[int], AbstractContextManager[Any]],
    *,
    threads: int = 8,
    rounds: int = 10,
) -> tuple[int, list[str], int]:
    """Run ``threads`` workers of ``rounds`` sections each; ``section(i)`` is worker ``i``'s
    critical section. Returns (counter, ids written, sections acknowledged)."""
    ident = sql.Identifier(f"counter_{uuid.uuid4().hex[:12]}")
    with psycopg.connect(pg_dsn, autocommit=True, application_name=app_name) as setup:
        setup.execute(sql.SQL("CREATE TABLE {} (v int, ids text[])").format(ident))
        setup.execute(sql.SQL("INSERT INTO {} VALUES (0, '{{}}')").format(ident))
    acknowledged = 0
    ack_lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def worker(i: int) -> None:
        nonlocal acknowledged
        rng = random.Random(i)
        try:
            with psycopg.connect(pg_dsn, autocommit=True, application_name=app_name) as side:
                start.wait(timeout=30)
                for r in range(rounds):
                    with section(i):
                        row = side.execute(sql.SQL("SELECT v, ids FROM {}").format(ident))
                        v, ids = row.fetchone()  # type: ignore[misc]
                        time.sleep(rng.uniform(0, 0.003))
                        side.execute(
                            sql.SQL("UPDATE {} SET v = %s, ids = %s").format(ident),
                            (v + 1, [*ids, f"{i}-{r}"]),
                        )
                    with ack_lock:
                        acknowledged += 1
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in ts), "a worker hung"
    assert not errors, errors
    with psycopg.connect(pg_dsn, autocommit=True, application_name=app_name) as check:
        v, ids = check.execute(sql.SQL("SELECT v, ids FROM {}").format(ident)).fetchone()  # type: ignore[misc]
        check.execute(sql.SQL("DROP TABLE {}").format(ident))
    return v, ids, acknowledged
