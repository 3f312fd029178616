"""T24: the shared lock table is full ("out of shared memory", SQLSTATE 53200).

A throwaway cluster with max_locks_per_transaction=10 and max_connections=10 (a lock table of
a few hundred entries). A raw session fills it; pglock must then raise LockTableFull, hold
nothing (a multi-name lock that got halfway gives back what it took), leave the connection
usable, and everything works again once the filler lets go.

Note for observers: a query that touches a shared catalog (pg_database, pg_authid, hence
pg_stat_activity) needs a slot in the shared lock table too, so it fails while the table is
full; the oracles filter pg_locks by pid for that reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import pglock

from .cluster import Cluster
from .oracles import truth

CLUSTER_SETTINGS = {"max_locks_per_transaction": 10, "max_connections": 10}

Connect = Callable[..., psycopg.Connection[Any]]

def fill(filler: psycopg.Connection[Any]) -> int:
    """Take session locks on 1, 2, 3, ... until the table is full; return how many are held."""
    with pytest.raises(psycopg.errors.OutOfMemory):
        filler.execute("SELECT count(pg_advisory_lock(k)) FROM generate_series(1, 1000000) k")
    row = filler.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_T24_lock_table_full(
    cluster: Cluster,
    cluster_connect: Connect,
    name: str,
) -> None:
    conn, obs = cluster_connect(), cluster_connect()
    kept = pglock.pg_lock(conn, name + ":kept")
    assert kept.acquire()
    filler = cluster_connect()
    filled = fill(filler)
    assert filled > 0

    # Session lock: a clear error, nothing new held, the connection usable.
    with pytest.raises(pglock.LockTableFull):
        pglock.pg_lock(conn, name).acquire()
    assert truth(obs, conn.info.backend_pid) == {pglock.key(name + ":kept"): "x"}
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert conn.execute("SELECT 1").fetchone() == (1,)

    # Transaction lock: the error, and the caller's transaction still usable.
    with conn.transaction():
        conn.execute("SELECT 1")
        with pytest.raises(pglock.LockTableFull):
            pglock.xact_lock(conn, name)
        assert conn.execute("SELECT 2").fetchone() == (2,)
    assert truth(obs, conn.info.backend_pid) == {pglock.key(name + ":kept"): "x"}

    # Locks already held stay held.
    row = obs.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s",
        (filler.info.backend_pid,),
    ).fetchone()
    assert row == (filled,)

    # Once the filler lets go, locks (and ordinary table locks) work again.
    filler.execute("SELECT pg_advisory_unlock_all()")
    with pglock.pg_lock(conn, name):
        assert len(truth(obs, conn.info.backend_pid)) == 2
    obs.execute("CREATE TEMP TABLE t24 (v int)")
    kept.release()
    assert truth(obs, conn.info.backend_pid) == {}


def test_T24_error_names_the_lock(cluster_connect: Connect, name: str) -> None:
    conn = cluster_connect()  # connect first: a new backend needs lock-table slots itself
    conn.execute("SELECT 1")
    filler = cluster_connect()
    fill(filler)
    try:
        with pytest.raises(pglock.LockTableFull) as info:
            pglock.pg_lock(conn, name).acquire()
        assert info.value.name == name
        assert isinstance(info.value.__cause__, psycopg.errors.OutOfMemory)
    finally:
        filler.execute("SELECT pg_advisory_unlock_all()")


def test_T24_multi_name_lock_full_halfway_gives_back_what_it_took(
    cluster_connect: Connect, name: str
) -> None:
    conn, obs, filler = cluster_connect(), cluster_connect(), cluster_connect()
    conn.execute("SELECT 1")
    fill(filler)
    filler.execute("SELECT pg_advisory_unlock(k) FROM generate_series(1, 3) k")  # room for 3
    names = [f"{name}:{i}" for i in range(10)]
    try:
        with pytest.raises(pglock.LockTableFull):
            pglock.pg_lock(conn, names).acquire()
        assert truth(obs, conn.info.backend_pid) == {}  # all or nothing
    finally:
        conn.execute("SELECT pg_advisory_unlock_all()")  # do not leak into the leak check
        filler.execute("SELECT pg_advisory_unlock_all()")
