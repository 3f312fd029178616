"""Lease scenarios on a throwaway cluster with the pglock schema installed.

T02 killed lease holder (held until expiry, then a larger token), T03 terminated lease
connections, T04 paused holder and fencing (guard) with its unfenced negative control, T12
leases across restarts, T15 concurrent first acquire under every isolation level, T14 token
sequence at its maximum (last: it exhausts this cluster's sequence).

Assertions compare database-clock facts (``acquired_at`` vs the dead lease's ``expires_at``),
never wall-clock durations; durations are only recorded as measured bounds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import pglock

from .cluster import Cluster
from .conftest import Bounds
from .procs import Holder, HolderError

if not hasattr(pglock, "lease"):
    pytest.skip("pglock.lease is not there yet", allow_module_level=True)

from pglock import _schema

# Grants must survive an immediate (crash) restart: keep commits synchronous here.
CLUSTER_SETTINGS = {"synchronous_commit": "on", "max_connections": 80}

BIGINT_MAX = 9223372036854775807


@pytest.fixture(scope="module")
def leases_db(cluster: Cluster) -> Cluster:
    _schema.install(cluster.dsn())
    return cluster


@pytest.fixture
def dsn(leases_db: Cluster, app_name: str) -> str:
    return leases_db.dsn(application_name=app_name)


@pytest.fixture
def obs(leases_db: Cluster) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(leases_db.dsn(), autocommit=True, application_name="pglock-obs") as c:
        yield c


@pytest.fixture
def fenced(obs: psycopg.Connection[Any]) -> Iterator[str]:
    name = f"fenced_{int(time.time() * 1e6)}"
    obs.execute(sql.SQL("CREATE TABLE {} (v text, at bigserial)").format(sql.Identifier(name)))
    yield name
    obs.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))


def info(obs: psycopg.Connection[Any], name: str) -> Any:
    return pglock.lease_info(obs, name)


# --- T02 ---------------------------------------------------------------------------------------


def test_T02_killed_lease_holder_held_until_expiry_then_larger_token(
    dsn: str,
    app_name: str,
    name: str,
    obs: psycopg.Connection[Any],
    holders: Callable[..., Holder],
    bounds: Bounds,
) -> None:
    h = holders()
    h.request("connect", dsn=dsn, app=app_name)
    dead_token = h.request("lock", kind="lease", source=dsn, name=name, ttl=2, keepalive=False)[
        "token"
    ]
    dead = info(obs, name)
    assert dead.token == dead_token
    killed = h.kill()
    # Others must not get it before it expires on the database clock.
    with pytest.raises(pglock.LockNotAcquired), pglock.lease(dsn, name, ttl=5, timeout=0):
        pass
    with pglock.lease(dsn, name, ttl=5, timeout=15) as lease:
        got = time.monotonic()
        assert lease.token > dead_token
        now = info(obs, name)
        assert now.acquired_at >= dead.expires_at
    bounds.record("T02", "lease", "waiter got a SIGKILLed holder's lease (ttl 2 s)", got - killed)


# --- T03 ---------------------------------------------------------------------------------------


def test_T03_terminated_lease_connections(
    dsn: str, app_name: str, name: str, obs: psycopg.Connection[Any], bounds: Bounds
) -> None:
    """Killing the backends a lease source uses does not end the lease (it is a row, not a
    session): the next renewal reconnects and keeps the same token, and nobody else can get
    the lease meanwhile. pglock's belief matches the lease table throughout."""
    with pglock.lease(dsn, name, ttl=3) as lease:
        token = lease.token
        obs.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
            " WHERE application_name = %s",
            (app_name,),
        )
        with pytest.raises(pglock.LockNotAcquired), pglock.lease(dsn, name, ttl=3, timeout=0):
            pass
        lease.extend()
        lease.check()
        row = info(obs, name)
        assert (row.holder, row.token) == (lease.holder, token)


# --- T04 ---------------------------------------------------------------------------------------


def test_T04_paused_holder_is_fenced(
    dsn: str,
    app_name: str,
    name: str,
    obs: psycopg.Connection[Any],
    holders: Callable[..., Holder],
    fenced: str,
    bounds: Bounds,
) -> None:
    """A holder SIGSTOPped past its TTL: the lease is taken over with a larger token; on
    resume its guarded write is refused (LockLost) and check() says lost. Negative control: the
    same holder's unguarded write goes through and lands after the new holder's (the known
    limit: only fenced writes are safe)."""
    table = sql.Identifier(fenced).as_string(obs)
    insert = f"INSERT INTO {table} (v) VALUES (%s)"
    a = holders()
    a.request("connect", dsn=dsn, app=app_name)
    a_token = a.request("lock", kind="lease", source=dsn, name=name, ttl=1.5)["token"]
    a.request("lease_write", name=name, sql=insert, params=["a-before"])
    a.stop()
    stopped = time.monotonic()
    try:
        with pglock.lease(dsn, name, ttl=10, timeout=15) as b:
            took_over = time.monotonic()
            assert b.token > a_token
            with psycopg.connect(dsn) as bc, bc.transaction():
                b.guard(bc)
                bc.execute(insert, ("b",))
            a.cont()
            with pytest.raises(HolderError) as refused:
                a.request("lease_write", name=name, sql=insert, params=["a-stale"])
            assert refused.value.error == "LockLost"
            with pytest.raises(HolderError) as lost:
                a.request("lease_check", name=name)
            assert lost.value.error == "LockLost"
            # The negative control: without guard() the paused holder clobbers.
            a.request("lease_write", name=name, sql=insert, params=["a-unfenced"], guard=False)
    finally:
        a.cont()
    rows = [r[0] for r in obs.execute(f"SELECT v FROM {table} ORDER BY at").fetchall()]
    assert rows == ["a-before", "b", "a-unfenced"]
    bounds.record(
        "T04", "lease", "takeover after the holder was paused (ttl 1.5 s)", took_over - stopped
    )


# --- T12 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_T12_leases_survive_restart_and_tokens_never_go_back(
    mode: str, leases_db: Cluster, app_name: str, name: str
) -> None:
    # Each phase on its own DSN string, so no connection of the source outlives the restart.
    before = leases_db.dsn(application_name=app_name, connect_timeout=5)
    after = leases_db.dsn(application_name=app_name, connect_timeout=6)
    lease = pglock.lease(before, name, ttl=5, keepalive=False).__enter__()
    token = lease.token
    leases_db.restart(mode)
    with psycopg.connect(leases_db.dsn(), autocommit=True) as obs:
        row = info(obs, name)
        assert row is not None and row.token == token and row.holder == lease.holder
    with pytest.raises(pglock.LockNotAcquired), pglock.lease(after, name, ttl=5, timeout=0):
        pass  # still held by its holder after the restart
    with pglock.lease(after, name + ":after", ttl=5, timeout=0) as later:
        assert later.token > token
    # The first lease is left to expire (its source's connections died with the server).


def test_T12_lease_renewal_after_restart_reconnects(
    leases_db: Cluster, dsn: str, name: str, bounds: Bounds
) -> None:
    with pglock.lease(dsn, name, ttl=15) as lease:
        token = lease.token
        leases_db.restart("fast")
        t0 = time.monotonic()
        lease.extend()  # the source should reconnect; the same grant goes on
        bounds.record("T12", "lease", "extend after a fast restart", time.monotonic() - t0)
        assert lease.token == token


# --- T15 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read", "serializable"])
def test_T15_concurrent_first_acquire_has_one_winner(
    isolation: str, leases_db: Cluster, app_name: str, name: str
) -> None:
    dsn = leases_db.dsn(
        application_name=app_name,
        options="-c default_transaction_isolation=" + isolation.replace(" ", "\\ "),
    )
    n = 16
    for round_ in range(6):  # several rounds: the race must be won cleanly every time
        winners, losers, others = race_once(dsn, f"{name}:{round_}", n)
        assert [type(e).__name__ for e in others] == []
        assert len(winners) == 1
        assert len(losers) == n - 1


def race_once(dsn: str, name: str, n: int) -> tuple[list[int], list[Any], list[BaseException]]:
    """``n`` threads released together try once for a new lease name."""
    barrier = threading.Barrier(n)
    done = threading.Barrier(n)
    winners: list[int] = []
    losers: list[BaseException] = []
    others: list[BaseException] = []

    def race() -> None:
        held = None
        try:
            barrier.wait(10)
            held = pglock.lease(dsn, name, ttl=10, timeout=0).__enter__()
            winners.append(held.token)
        except pglock.LockNotAcquired as exc:
            losers.append(exc)
        except BaseException as exc:
            others.append(exc)
        finally:
            with contextlib.suppress(threading.BrokenBarrierError):
                done.wait(20)  # the winner holds until every racer has finished
            if held is not None:
                held.__exit__(None, None, None)

    threads = [threading.Thread(target=race) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return winners, losers, others


# --- T13 ---------------------------------------------------------------------------------------


def test_T13_lease_expiry_uses_the_database_clock_not_now(leases_db: Cluster, name: str) -> None:
    """A grant made inside a transaction that began 1.5 s earlier: expires_at is ttl after
    clock_timestamp(), not after now() (frozen at the transaction start), so the lease is not
    born partly expired. Asserted on the database clock only."""
    with psycopg.connect(leases_db.dsn()) as c:
        c.execute("SELECT pg_sleep(1.5)")
        row = c.execute(
            "SELECT granted, acquired_at, expires_at, expires_at - clock_timestamp(),"
            " acquired_at - now() FROM pglock.acquire(%s, %s, %s)",
            (name, "t13-holder", 2.0),
        ).fetchone()
        assert row is not None
        granted, _acquired, _expires, left, after_start = row
        assert granted
        assert after_start.total_seconds() >= 1.5  # granted on the current clock
        assert left.total_seconds() > 1.9  # a full TTL ahead, not 2 - 1.5
        c.rollback()


# --- T28 (search_path hijack) -----------------------------------------------------------------


def test_T28_search_path_hijack_is_harmless(
    leases_db: Cluster, app_name: str, name: str, obs: psycopg.Connection[Any]
) -> None:
    """Shadowing objects planted in public and pg_temp, and a search_path that puts them
    first: lease operations still use the pglock schema's own objects."""
    from psycopg_pool import ConnectionPool

    obs.execute("CREATE TABLE IF NOT EXISTS public.lease (name text, holder text, token bigint)")
    obs.execute("CREATE SEQUENCE IF NOT EXISTS public.lease_token")

    def plant(conn: psycopg.Connection[Any]) -> None:
        conn.execute("CREATE TEMP TABLE IF NOT EXISTS lease (name text, holder text, token bigint)")
        conn.execute("SET search_path = pg_temp, public, pglock")
        conn.commit()

    try:
        with (
            ConnectionPool(
                leases_db.dsn(),
                min_size=1,
                max_size=2,
                kwargs={"application_name": app_name, "autocommit": True},
                configure=plant,
            ) as pool,
            pglock.lease(pool, name, ttl=5, timeout=0) as lease,
        ):
            assert lease.token > 0
            row = info(obs, name)
            assert row is not None and row.token == lease.token
            with pool.connection() as c:
                assert c.execute("SELECT count(*) FROM pg_temp.lease").fetchone() == (0,)
        assert obs.execute("SELECT count(*) FROM public.lease").fetchone() == (0,)
        assert obs.execute("SELECT is_called FROM public.lease_token").fetchone() == (False,)
    finally:
        obs.execute("DROP TABLE IF EXISTS public.lease")
        obs.execute("DROP SEQUENCE IF EXISTS public.lease_token")


# --- T14 (last: exhausts the sequence) ------------------------------------------------------


def test_T14_token_sequence_at_its_maximum_never_wraps(
    dsn: str, name: str, obs: psycopg.Connection[Any]
) -> None:
    assert obs.execute(
        "SELECT cycle FROM pg_sequences"
        " WHERE schemaname = 'pglock' AND sequencename = 'lease_token'"
    ).fetchone() == (False,)
    obs.execute(f"ALTER SEQUENCE pglock.lease_token RESTART WITH {BIGINT_MAX - 1}")
    tokens = []
    for i in range(2):
        with pglock.lease(dsn, f"{name}:{i}", ttl=5, timeout=0) as lease:
            tokens.append(lease.token)
    assert tokens == [BIGINT_MAX - 1, BIGINT_MAX]
    with (
        pytest.raises(pglock.LockError, match="exhausted"),
        pglock.lease(dsn, f"{name}:2", ttl=5, timeout=0),
    ):
        pass
    assert info(obs, f"{name}:2") is None  # nothing granted without a token
    assert obs.execute("SELECT last_value FROM pglock.lease_token").fetchone() == (BIGINT_MAX,)
