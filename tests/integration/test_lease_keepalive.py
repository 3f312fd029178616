"""The keepalive: one thread per process, one batched statement per renewal round."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool
from test_lease_support import wait_until

import pglock

pytestmark = pytest.mark.timeout(120)


def keepalive_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pglock-keepalive"]


def test_1000_leases_are_renewed_by_one_thread_in_one_statement_per_round(
    statements: Any,
    dsn: str, name: str, record_property: Any
) -> None:
    n, ttl = 1000, 1.5
    with ConnectionPool(dsn, min_size=2, max_size=4, open=True) as pool, psycopg.connect(
        dsn, autocommit=True
    ) as admin:
        leases = [pglock.lease(pool, f"{name}:{i}", ttl=ttl, timeout=0) for i in range(n)]
        try:
            for lease in leases:
                assert lease.acquire()
            assert len(keepalive_threads()) == 1
            # Let the renewal rounds of leases acquired over a second or two merge.
            time.sleep(ttl)
            before = statements["extend_many"]
            window = 2 * ttl
            time.sleep(window)
            rounds = statements["extend_many"] - before
            record_property("keepalive_statements_in_2_ttls_1000_leases", rounds)
            # A round every ttl/3: about 6 in the window; one statement per lease would be
            # about 6,000.
            assert 2 <= rounds <= 15, rounds
            assert not any(lease.lost for lease in leases)
            row = admin.execute(
                "SELECT count(*), min(expires_at - clock_timestamp()) FROM pglock.lease"
                " WHERE name LIKE %s",
                (f"{name}:%",),
            ).fetchone()
            assert row is not None and row[0] == n
            assert row[1].total_seconds() > 0  # every one of them alive on the server
            assert len(keepalive_threads()) == 1
        finally:
            for lease in leases:
                if lease.locked:
                    lease.release()
        assert wait_until(
            lambda: admin.execute(
                "SELECT count(*) FROM pglock.lease WHERE name LIKE %s", (f"{name}:%",)
            ).fetchone() == (0,),
            10,
        )
