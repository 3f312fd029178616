"""Lease scenarios on a throwaway cluster with the pglock schema installed.

T02 killed lease holder (held until expiry, then a larger token), T03 terminated lease
connections, T04 paused holder and fencing (guard) with its unfenced negative control, T12
leases across restarts, T15 concurrent first acquire under every isolation level, T10 a lease
source whose network goes silent (the other sources' leases live on, the silent one is lost at
its deadline; an acquire gives up after its timeout; semaphore permits renew in the same
per-source workers, one statement per kind and round), T14 token sequence at its maximum (last:
it exhausts this cluster's sequence).

Assertions compare database-clock facts (``acquired_at`` vs the dead lease's ``expires_at``),
never wall-clock durations; durations are only recorded as measured bounds.
"""

from __future__ import annotations

import contextlib
import logging
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
from .proxy import Proxy

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


# --- T10: a silent network (issue 11 items 7 and 9) -------------------------------------------


def lease_row(obs: psycopg.Connection[Any], name: str) -> tuple[Any, ...] | None:
    """(holder, token, expires_at, live?) of a lease row, on the database clock."""
    return obs.execute(
        "SELECT holder, token, expires_at, expires_at > clock_timestamp()"
        " FROM pglock.lease WHERE name = %s",
        (name,),
    ).fetchone()


def test_T10_a_silent_lease_source_delays_no_other_source(
    leases_db: Cluster, app_name: str, name: str, obs: psycopg.Connection[Any], bounds: Bounds
) -> None:
    """Two lease sources, one through a proxy that goes silent (no FIN, no RST: the proxy's
    kernel still acknowledges, so no TCP timeout fires), one direct. On main the single
    keepalive thread hung in the silent source's renewal: the healthy source's lease expired
    on the server and on_lost ran for neither. Now each source renews in its own worker: the
    healthy lease stays held with the same token, its expiry moving on, for several TTLs; the
    silent lease is declared lost at its client deadline (on_lost, check() raises LockLost)
    although its renewal never returns."""
    ttl = 1.5
    lost_at: list[float] = []
    lost = threading.Event()
    healthy_lost: list[pglock.Lease] = []

    def on_lost(_lease: pglock.Lease) -> None:
        lost_at.append(time.monotonic())
        lost.set()

    with Proxy(leases_db.port) as proxy:
        silent_dsn = leases_db.dsn(port=proxy.port, application_name=app_name)
        healthy_dsn = leases_db.dsn(application_name=app_name)
        silent = pglock.lease(silent_dsn, f"{name}:silent", ttl=ttl, on_lost=on_lost)
        healthy = pglock.lease(healthy_dsn, f"{name}:healthy", ttl=ttl, on_lost=healthy_lost.append)
        assert silent.acquire(timeout=5) and healthy.acquire(timeout=5)
        proxy.set_mode("blackhole")
        cut = time.monotonic()
        first = lease_row(obs, f"{name}:healthy")
        assert first is not None and first[:2] == (healthy.holder, healthy.token)
        seen = [first[2]]
        while time.monotonic() < cut + 3 * ttl:  # bounded: three TTLs
            row = lease_row(obs, f"{name}:healthy")
            assert row is not None and row[:2] == (healthy.holder, healthy.token), row
            assert row[3] is True, f"the healthy source's lease expired on the server: {row}"
            if row[2] != seen[-1]:
                seen.append(row[2])
            time.sleep(0.1)
        assert len(seen) >= 4 and seen == sorted(seen)  # renewed about every ttl/3
        assert lost.wait(10), "on_lost never ran for the silent source's lease"
        with pytest.raises(pglock.LockLost):
            silent.check()
        assert silent.lost and not silent.locked
        assert healthy_lost == [] and healthy.locked
        healthy.check()
        deadline = silent._deadline
        assert lost_at[0] >= deadline  # never before its deadline
        bounds.record(
            "T10", "lease", "silent source: on_lost after the lease's client deadline (ttl 1.5 s)",
            lost_at[0] - deadline,
        )
        healthy.release()
        # The release into the silent network gets no answer: an error, within its bound.
        t0 = time.monotonic()
        with pytest.raises((pglock.LockLost, psycopg.OperationalError)):
            silent.release()
        bounds.record(
            "T10", "lease", "release into a silent network gave up (ttl 1.5 s)",
            time.monotonic() - t0,
        )
    assert lease_row(obs, f"{name}:healthy") is None


def permit_row(obs: psycopg.Connection[Any], holder: str) -> tuple[Any, ...] | None:
    """(expires_at, live?) of a semaphore permit row, on the database clock."""
    return obs.execute(
        "SELECT expires_at, expires_at > clock_timestamp() FROM pglock.semaphore_permit"
        " WHERE holder = %s",
        (holder,),
    ).fetchone()


def test_T10_a_silent_semaphore_source_delays_no_other_source(
    statements: Any,
    leases_db: Cluster, app_name: str, name: str, obs: psycopg.Connection[Any], bounds: Bounds
) -> None:
    """Semaphore permits renew in the leases' per-source keepalive (issue 11, one TTL-row
    client). On main every Semaphore object had a keepalive thread of its own: one renewal
    statement per object and round, none of them counted with the lease statements. Now a
    process renews the permits of all its semaphores on a (source, schema) in one
    ``semaphore_extend`` statement per round, next to one ``extend_many`` for its leases there.
    Then one source goes silent (the fault proxy): the other source's permits and lease stay
    renewed for several TTLs, and the silent source's permit is reported lost at its client
    deadline (a WARNING on ``pglock.semaphore``) although its renewal never returns."""
    ttl = 1.5
    lost_at: list[float] = []
    lost = threading.Event()
    silent_name = f"{name}:silent"

    class Losses(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if record.levelno >= logging.WARNING and "lost" in message and silent_name in message:
                lost_at.append(time.monotonic())
                lost.set()

    handler = Losses()
    logging.getLogger("pglock.semaphore").addHandler(handler)
    try:
        with Proxy(leases_db.port) as proxy:
            silent_dsn = leases_db.dsn(port=proxy.port, application_name=app_name)
            healthy_dsn = leases_db.dsn(application_name=app_name)
            leases = [pglock.lease(silent_dsn, silent_name, ttl=ttl),
                      pglock.lease(healthy_dsn, f"{name}:healthy", ttl=ttl)]
            assert all(lease.acquire(timeout=5) for lease in leases)
            silent_sem = pglock.semaphore(silent_dsn, silent_name, 1, ttl=ttl)
            healthy_sems = [
                pglock.semaphore(healthy_dsn, f"{name}:healthy:{i}", 2, ttl=ttl) for i in range(3)
            ]
            silent = silent_sem.hold(timeout=5).__enter__()
            healthy = [sem.hold(timeout=5).__enter__() for sem in healthy_sems]

            # One statement per kind, (source, schema) and round: two sources, so as many
            # semaphore renewals as lease renewals (give or take a round cut by the window
            # at each end), not one per Semaphore object (four).
            time.sleep(ttl)  # the rounds of grants made a few ms apart merge
            before = dict(statements)
            time.sleep(2 * ttl)
            after = dict(statements)
            lease_rounds = after.get("extend_many", 0) - before.get("extend_many", 0)
            permit_rounds = after.get("semaphore_extend", 0) - before.get("semaphore_extend", 0)
            assert lease_rounds >= 4, lease_rounds  # about 6 per source
            assert abs(permit_rounds - lease_rounds) <= 2, (permit_rounds, lease_rounds)

            proxy.set_mode("blackhole")
            cut = time.monotonic()
            seen: dict[str, list[Any]] = {p.holder: [] for p in healthy}
            while time.monotonic() < cut + 3 * ttl:  # bounded: three TTLs
                for permit in healthy:
                    row = permit_row(obs, permit.holder)
                    assert row is not None and row[1] is True, f"a healthy permit expired: {row}"
                    if not seen[permit.holder] or row[0] != seen[permit.holder][-1]:
                        seen[permit.holder].append(row[0])
                row = lease_row(obs, f"{name}:healthy")
                assert row is not None and row[3] is True, f"the healthy lease expired: {row}"
                time.sleep(0.1)
            for renewals in seen.values():
                assert len(renewals) >= 4 and renewals == sorted(renewals)  # about every ttl/3
            assert lost.wait(10), "the silent source's permit was never reported lost"
            assert lost_at[0] >= silent._deadline  # never before its client deadline
            bounds.record(
                "T10", "semaphore",
                "silent source: permit reported lost after its client deadline (ttl 1.5 s)",
                lost_at[0] - silent._deadline,
            )
            assert not silent.locked
            with pytest.raises(pglock.LockLost):
                silent.check()
            for permit in healthy:
                assert permit.locked
                permit.check()
                permit.release()
            leases[1].check()
            leases[1].release()
            for handle in (silent, leases[0]):  # into the silent network: an error, bounded
                with pytest.raises((pglock.LockLost, psycopg.OperationalError)):
                    handle.release()
            assert all(permit_row(obs, p.holder) is None for p in healthy)
    finally:
        logging.getLogger("pglock.semaphore").removeHandler(handler)


@pytest.mark.parametrize("warm", [True, False], ids=["idle-connection", "new-connection"])
@pytest.mark.parametrize("timeout", [1.0, 0.0], ids=["timeout=1", "timeout=0"])
def test_T10_acquire_into_a_silent_network_gives_up_after_its_timeout(
    timeout: float,
    warm: bool,
    leases_db: Cluster,
    app_name: str,
    name: str,
    obs: psycopg.Connection[Any],
    bounds: Bounds,
) -> None:
    """``acquire(timeout=t)`` with a silent path to the database (on main it was still blocked
    long after its timeout: no connect_timeout, no statement deadline). It returns False once
    ``t`` plus the answer grace has passed, through an idle connection of the source (the
    statement is cut off) or a new one (the connect is given up); ``with`` raises
    LockNotAcquired. Nothing was granted: the proxy forwarded nothing."""
    with Proxy(leases_db.port) as proxy:
        dsn = leases_db.dsn(port=proxy.port, application_name=app_name)
        if warm:
            assert pglock.lease_info(dsn, name) is None  # leaves an idle connection
        proxy.set_mode("blackhole")
        out: list[Any] = []
        took: list[float] = []

        def attempt() -> None:
            t0 = time.monotonic()
            try:
                out.append(pglock.lease(dsn, name, ttl=5).acquire(timeout=timeout))
            except BaseException as exc:
                out.append(exc)
            took.append(time.monotonic() - t0)

        def enter() -> None:
            try:
                with pglock.lease(dsn, name, ttl=5, timeout=timeout):
                    out.append("entered")
            except BaseException as exc:
                out.append(exc)

        for target in (attempt, enter):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            thread.join(20)  # a generous bound: the measured figure is recorded below
            assert not thread.is_alive(), "acquire() was still blocked 20 s later"
        assert out[0] is False, out
        assert isinstance(out[1], pglock.LockNotAcquired), out
        assert "no answer" in str(out[1])
        bounds.record(
            "T10", "lease",
            f"acquire(timeout={timeout:g}) into a silent network returned False "
            f"({'idle' if warm else 'new'} connection)",
            took[0],
        )
    assert pglock.lease_info(obs, name) is None


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
