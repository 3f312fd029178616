"""T01: mutual exclusion under contention, with the lost-update and overlap oracles.

8 processes x 4 threads, each thread with its own lock connection and its own oracle
connection, run critical sections on one lock name. Inside: the overlap audit row, a non-atomic
read / sleep 0-3 ms / write of a shared counter and id set. Every lock kind must lose nothing;
the negative control (no lock) must lose updates, or the oracle proves nothing.

Runs on a throwaway cluster so the 70-odd sessions do not crowd the shared server.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import pglock

from .cluster import Cluster
from .oracles import Oracle, Verdict, held_by_app
from .procs import Holder

CLUSTER_SETTINGS = {"max_connections": 200}  # semaphore holders add listener connections

PROCS, THREADS, ITERATIONS = 8, 4, 25

KINDS = ["session", "xact"]
if hasattr(pglock, "pool_lock"):
    KINDS.append("pool")
if hasattr(pglock, "lease"):
    KINDS.append("lease")


def run_workload(
    cluster: Cluster,
    holders: Callable[..., Holder],
    app_name: str,
    kind: str,
    name: str,
    *,
    iterations: int = ITERATIONS,
    ttl: float | None = None,
    share_conn: bool = False,
    limit: int | None = None,
) -> tuple[Verdict, list[str]]:
    if kind in ("lease", "semaphore"):
        from pglock import _schema

        _schema.install(cluster.dsn())
    with psycopg.connect(cluster.dsn(), autocommit=True, application_name=app_name) as admin:
        oracle = Oracle.create(admin)
        try:
            procs = [holders(wait=False) for _ in range(PROCS)]
            for p in procs:
                p.wait_ready()
            for i, p in enumerate(procs):
                p.request(
                    "prepare",
                    dsn=cluster.dsn(),
                    app=app_name,
                    oracle=oracle.prefix,
                    kind=kind,
                    name=name,
                    threads=THREADS,
                    iterations=iterations,
                    worker=f"p{i}",
                    ttl=ttl,
                    share_conn=share_conn,
                    limit=limit,
                    timeout=60,
                )
            for p in procs:
                p.send("go")
            acked: list[str] = []
            errors: list[str] = []
            for p in procs:
                out = p.reply(timeout=110)
                assert out.get("ok"), out
                acked += out["acked"]
                errors += out["errors"]
            verdict = oracle.check(admin, acked)
            assert held_by_app(admin, app_name) == []
            return verdict, errors
        finally:
            oracle.drop(admin)


@pytest.mark.parametrize("kind", KINDS)
def test_T01_mutual_exclusion(
    kind: str, cluster: Cluster, holders: Callable[..., Holder], app_name: str, name: str
) -> None:
    verdict, errors = run_workload(cluster, holders, app_name, kind, name)
    assert errors == []
    assert len(verdict.acked) == PROCS * THREADS * ITERATIONS
    assert verdict.clean, verdict.summary()
    assert verdict.max_concurrency == 1
    if kind == "lease":
        assert len(verdict.tokens) == len(verdict.acked)


@pytest.mark.skipif(not hasattr(pglock, "lease"), reason="no leases yet")
def test_T14_tokens_rise_in_grant_order_under_contention(
    cluster: Cluster, holders: Callable[..., Holder], app_name: str, name: str
) -> None:
    """Fencing tokens, recorded in the audit row on entry, must rise in enter order (the
    acquire function draws a token only once its transaction holds the lease row; the
    deterministic schedule is in tests/integration/test_lease.py)."""
    verdict, errors = run_workload(cluster, holders, app_name, "lease", name, iterations=15)
    assert errors == []
    assert verdict.clean, verdict.summary()
    bad = [(a, b) for a, b in itertools.pairwise(verdict.tokens) if a >= b]
    assert bad == [], f"tokens not increasing in enter order: {bad[:10]}"


def test_T01_negative_control_finds_lost_updates(
    cluster: Cluster, holders: Callable[..., Holder], app_name: str, name: str
) -> None:
    """The same workload with the lock replaced by a no-op: the oracles must catch it."""
    verdict, errors = run_workload(cluster, holders, app_name, "none", name, iterations=6)
    assert errors == []
    assert not verdict.clean
    assert verdict.lost, verdict.summary()
    assert verdict.counter < len(verdict.acked)
    assert verdict.overlaps > 0
    assert verdict.max_concurrency > 1


def test_T05_threads_sharing_a_connection_in_every_process(
    cluster: Cluster, holders: Callable[..., Holder], app_name: str, name: str
) -> None:
    """8 processes, each with 4 threads sharing ONE connection: pglock arbitrates the threads
    of a session (Postgres would grant the session's lock to all of them) and Postgres the
    sessions. Nothing may be lost."""
    verdict, errors = run_workload(
        cluster, holders, app_name, "session", name, iterations=12, share_conn=True
    )
    assert errors == []
    assert verdict.clean, verdict.summary()
    assert verdict.max_concurrency == 1


def test_T05_negative_control_raw_locks_on_shared_connections(
    cluster: Cluster, holders: Callable[..., Holder], app_name: str, name: str
) -> None:
    """Raw pg_advisory_lock on connections shared by threads: the oracle must see the
    overlaps and lost updates that Postgres's per-session re-entrancy allows."""
    verdict, errors = run_workload(
        cluster, holders, app_name, "raw_session", name, iterations=6, share_conn=True
    )
    assert errors == []
    assert verdict.overlaps > 0, verdict.summary()
    assert verdict.lost, verdict.summary()


@pytest.mark.skipif(not hasattr(pglock, "semaphore"), reason="no semaphores yet")
def test_T21_semaphore_never_exceeds_its_limit(
    cluster: Cluster, holders: Callable[..., Holder], app_name: str, name: str
) -> None:
    """Semaphore(limit=3) under the T01 load: at most 3 sections at once, and 3 reached (so the
    audit could see a breach). Lost updates are expected here: 3 holders share the counter."""
    verdict, errors = run_workload(
        cluster, holders, app_name, "semaphore", name, iterations=8, limit=3
    )
    assert errors == []
    assert verdict.max_concurrency == 3, verdict.summary()


@pytest.mark.skipif(not hasattr(pglock, "rwlock"), reason="no rwlock yet")
def test_T21_rwlock_writers_exclude_everyone_readers_share(
    cluster: Cluster, holders: Callable[..., Holder], app_name: str, name: str
) -> None:
    """rwlock under the T01 load, 20 % writers: no section overlaps a writer's, and readers
    do overlap (so the audit could see it)."""
    with psycopg.connect(cluster.dsn(), autocommit=True, application_name=app_name) as admin:
        verdict, errors, writer_overlaps = _rwlock_run(cluster, holders, app_name, name, admin)
    assert errors == []
    assert writer_overlaps == 0
    assert verdict.max_concurrency > 1, verdict.summary()


def _rwlock_run(
    cluster: Cluster,
    holders: Callable[..., Holder],
    app_name: str,
    name: str,
    admin: psycopg.Connection[Any],
) -> tuple[Verdict, list[str], int]:
    from psycopg import sql

    oracle = Oracle.create(admin)
    try:
        procs = [holders(wait=False) for _ in range(PROCS)]
        for p in procs:
            p.wait_ready()
        for i, p in enumerate(procs):
            p.request(
                "prepare",
                dsn=cluster.dsn(),
                app=app_name,
                oracle=oracle.prefix,
                kind="rwlock",
                name=name,
                threads=THREADS,
                iterations=8,
                worker=f"p{i}",
                timeout=60,
            )
        for p in procs:
            p.send("go")
        acked: list[str] = []
        errors: list[str] = []
        for p in procs:
            out = p.reply(timeout=110)
            assert out.get("ok"), out
            acked += out["acked"]
            errors += out["errors"]
        verdict = oracle.check(admin, acked)
        row = admin.execute(
            sql.SQL(
                "SELECT count(*) FROM {a} x JOIN {a} y ON x.id < y.id"
                " WHERE x.enter_seq < y.exit_seq AND y.enter_seq < x.exit_seq"
                "   AND (x.token = 1 OR y.token = 1)"
            ).format(a=oracle.audit)
        ).fetchone()
        assert row is not None
        return verdict, errors, int(row[0])
    finally:
        oracle.drop(admin)
