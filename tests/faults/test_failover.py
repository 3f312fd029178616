"""T29: failover. A primary and a streaming standby (:mod:`.replication`), clients on the
multi-host conninfo (``target_session_attrs=read-write``: the primary, then the promoted
standby), the primary killed (``-m immediate``) and the standby promoted.

* a held lease survives promotion (holder, token, expiry), its keepalive renews it on the new
  primary before it expires, ``guard()`` works there (sync and async replication);
* advisory-lock holders learn of the loss (pg_lock, xact_lock, pool_lock, a blocked waiter),
  and the leader steps down while a leader is elected on the new primary;
* fencing tokens never go backwards after an asynchronous failover that loses acknowledged
  grants on purpose; the negative control (the schema at revision pglock_0003, plain
  ``nextval``) shows a token handed out twice;
* semaphores and rwlocks keep their invariants across the promotion.

Durations are recorded as measured bounds (``bounds``), never asserted.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

import pglock
from pglock import _schema, _source

from .cluster import Cluster, ClusterUnavailable
from .conftest import Bounds
from .oracles import wait_for
from .replication import Replicated

#: Leases and permits live this long without renewal: longer than a failover here (< 1 s).
TTL = 6.0


@pytest.fixture
def replicated() -> Iterator[Callable[..., Replicated]]:
    """Factory of primary + standby pairs, destroyed after the test."""
    made: list[Replicated] = []

    def factory(*, sync: bool) -> Replicated:
        try:
            pair = Replicated(sync=sync)
        except ClusterUnavailable as exc:
            if os.environ.get("CI"):
                pytest.fail(f"no replicated clusters under CI: {exc}", pytrace=False)
            pytest.skip(str(exc))
        made.append(pair)
        return pair

    yield factory
    _source.close_dsn_sources()  # connections to servers about to go away
    for pair in made:
        pair.destroy()


def install(pair: Replicated, upto: str | None = None) -> None:
    """The pglock schema on the primary (every revision, or up to ``upto``), replicated."""
    plan = _schema.revisions()
    if upto is not None:
        plan = plan[: [r.revision for r in plan].index(upto) + 1]
    with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
        _schema._install(conn, "pglock", plan)
    pair.wait_caught_up()


def lease_row(cluster: Cluster, name: str) -> tuple[Any, ...] | None:
    """(holder, token, expires_at, expires_at > now) of ``name`` on ``cluster``."""
    with psycopg.connect(cluster.dsn(), autocommit=True) as c:
        return c.execute(
            "SELECT holder, token, expires_at, expires_at > clock_timestamp()"
            " FROM pglock.lease WHERE name = %s", (name,),
        ).fetchone()


# --- leases -------------------------------------------------------------------------------


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_T29_held_lease_survives_promotion_and_renews_on_the_new_primary(
    replicated: Callable[..., Replicated], bounds: Bounds, sync: bool
) -> None:
    pair = replicated(sync=sync)
    install(pair)
    dsn = pair.conninfo()
    standby = pair.standby
    assert standby is not None
    name = "t29:lease"
    with pglock.lease(dsn, name, ttl=TTL, timeout=5, metadata={"by": "t29"}) as lease:
        token = lease.token
        before = lease_row(pair.primary, name)
        assert before is not None and before[:2] == (lease.holder, token)
        if not sync:
            pair.wait_caught_up()  # asynchronous: the grant must have reached the standby
        promoted = pair.failover()

        # On the new primary: the same holder and token, an expiry no earlier, still live.
        after = lease_row(standby, name)
        assert after is not None
        holder, token_after, expires_after, live = after
        assert (holder, token_after) == (lease.holder, token)
        assert expires_after >= before[2] and live
        lease.check()

        # The keepalive reconnects through the multi-host conninfo and renews it there.
        renewed = wait_for(
            lambda: lease.expires_at is not None and lease.expires_at > expires_after,
            timeout=TTL * 3, what="a renewal on the new primary",
        )
        took = time.monotonic() - promoted
        assert renewed
        row = lease_row(standby, name)
        assert row is not None and row[:2] == (lease.holder, token) and row[2] == lease.expires_at
        # Renewed before it expired, on the database clock: sent before the old expiry.
        assert lease.expires_at.timestamp() - TTL < expires_after.timestamp()
        lease.check()
        assert lease.locked and lease.token == token

        # guard() in a transaction on the new primary, reached through the same conninfo.
        with psycopg.connect(dsn) as conn:
            assert conn.info.port == standby.port
            with conn.transaction():
                lease.guard(conn)
                conn.execute("CREATE TABLE t29_fenced (v int)")
    bounds.record(
        "T29", "sync" if sync else "async", "promotion -> first lease renewal on the new primary",
        took,
    )
    assert lease_row(standby, name) is None  # released on the new primary


# --- advisory locks and the leader ----------------------------------------------------------


def test_T29_advisory_holders_learn_of_the_loss_and_a_leader_is_elected_on_the_new_primary(
    replicated: Callable[..., Replicated], bounds: Bounds
) -> None:
    pair = replicated(sync=True)
    dsn = pair.conninfo()
    standby = pair.standby
    assert standby is not None
    opened: list[psycopg.Connection[Any]] = []

    def connect(autocommit: bool = True) -> psycopg.Connection[Any]:
        c = psycopg.connect(dsn, autocommit=autocommit)
        opened.append(c)
        return c

    pool = ConnectionPool(
        dsn, min_size=1, max_size=2, open=True, reset=pglock.reset_connection,
        check=ConnectionPool.check_connection,  # see the semaphore and rwlock test
    )
    elections: list[pglock.LeaderElection] = []
    lost_at: dict[int, float] = {}
    try:
        holder = connect()
        held = pglock.pg_lock(holder, "t29:adv")
        assert held.acquire(timeout=5)
        # A waiter blocked on the old primary behind the holder.
        waiter_conn = connect()
        waited: dict[str, Any] = {}

        def wait() -> None:
            try:
                waited["ok"] = pglock.pg_lock(waiter_conn, "t29:adv").acquire(timeout=60)
            except BaseException as exc:
                waited["error"] = exc

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        with psycopg.connect(pair.primary.dsn(), autocommit=True) as obs:
            wait_for(
                lambda: obs.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ).fetchone()[0] == 1,  # type: ignore[index]
                what="the waiter to block",
            )
        xact_conn = connect(autocommit=False)
        pglock.xact_lock(xact_conn, "t29:xact")
        pooled = pglock.pool_lock(pool, "t29:pool", timeout=5)
        pooled.__enter__()

        for i in range(2):
            e = pglock.leader(
                dsn, "t29:leader", check_interval=0.2, network_timeout=2.0,
                on_lost=functools.partial(lambda i: lost_at.setdefault(i, time.monotonic()), i),
            )
            elections.append(e.start())
        first = wait_for(
            lambda: [e for e in elections if e.is_leader], timeout=30, what="a first leader"
        )[0]
        old_term = first.term
        assert old_term is not None

        killed = time.monotonic()
        promoted = pair.failover()

        # The leader steps down (on_lost), and a leader is elected on the new primary.
        wait_for(lambda: not first.is_leader, timeout=15, what="the old leader to step down")
        new = wait_for(
            lambda: [e for e in elections if e.is_leader], timeout=30, what="a new leader"
        )[0]
        elected = time.monotonic()
        wait_for(lambda: elections.index(first) in lost_at, what="the old leader's on_lost")
        with psycopg.connect(dsn) as conn:
            assert conn.info.port == standby.port
            with conn.transaction():
                new_term = new.guard(conn)
        assert new_term == new.term and new_term > old_term  # sync: the old term replicated
        bounds.record("T29", "leader", "kill -> old leader's on_lost",
                      lost_at[elections.index(first)] - killed)
        bounds.record("T29", "leader", "promotion -> new leader elected", elected - promoted)

        # pg_lock: the release reports the loss.
        with pytest.raises(pglock.LockLost):
            held.release()
        # The waiter blocked on the old primary gets a clear error, not a grant.
        waiter.join(30)
        assert not waiter.is_alive()
        assert "ok" not in waited, f"the waiter was granted a lock on a dead server: {waited}"
        assert isinstance(waited["error"], psycopg.OperationalError), waited
        # xact_lock: the transaction fails.
        with pytest.raises(psycopg.OperationalError):
            xact_conn.execute("SELECT 1")
        # pool_lock: the exit reports the loss (its connection is discarded).
        with pytest.raises(pglock.LockLost):
            pooled.__exit__(None, None, None)
        # Each lock can be taken on the new primary.
        again = connect()
        assert again.info.port == standby.port
        with pglock.pg_lock(again, "t29:adv", timeout=5):
            pass
        with connect(autocommit=False) as c2, c2.transaction():
            pglock.xact_lock(c2, "t29:xact", timeout=5)
        with pglock.pool_lock(pool, "t29:pool", timeout=10) as pc:
            assert pc.info.port == standby.port
    finally:
        for e in elections:
            e.resign()
        pool.close()
        for c in opened:
            with contextlib.suppress(Exception):
                c.close()


def test_T29_leader_terms_rise_after_an_async_failover_that_loses_a_term(
    replicated: Callable[..., Replicated],
) -> None:
    pair = replicated(sync=False)
    dsn = pair.conninfo()
    pair.wait_caught_up()
    pair.cut()
    with pglock.leader(dsn, "t29:term", check_interval=0.2, network_timeout=2.0) as election:
        assert election.wait_elected(30)
        lost_term = election.term  # committed on the old primary only
        assert lost_term is not None and pair.lag() > 0
        pair.failover()
        wait_for(lambda: not election.is_leader, timeout=15, what="the leader to step down")
        assert election.wait_elected(30)
        new_term = election.term
        assert new_term is not None
        assert new_term > lost_term, f"a term went back: {lost_term} then {new_term}"


# --- fencing tokens after an asynchronous failover that loses grants ----------------------

#: More grants than Postgres logs a sequence ahead (32 values per WAL record): past them the
#: old primary hands out tokens the standby never heard of.
LOST_GRANTS = 40


@pytest.mark.parametrize(
    "revision",
    [
        pytest.param(None, id="head"),
        pytest.param("pglock_0003", id="control-0003"),
    ],
)
def test_T29_tokens_never_go_backwards_after_an_async_failover_that_loses_grants(
    replicated: Callable[..., Replicated], revision: str | None
) -> None:
    pair = replicated(sync=False)
    install(pair, revision)
    dsn = pair.conninfo()
    standby = pair.standby
    assert standby is not None

    def grant(name: str) -> int:
        with pglock.lease(dsn, name, ttl=TTL, timeout=5) as lease:
            assert lease.token is not None
            return int(lease.token)

    first = grant("t29:tokens")
    pair.wait_caught_up()
    pair.cut()
    # Acknowledged grants on the old primary that never reach the standby.
    old = [grant(f"t29:tokens:{i % 4}") for i in range(LOST_GRANTS)]
    assert first < old[0] and old == sorted(set(old))
    assert pair.lag() > 0
    pair.failover()
    new = [grant(f"t29:tokens:{i % 4}") for i in range(5)]
    assert new == sorted(set(new))
    backwards = [t for t in new if t <= max(old)]
    if revision == "pglock_0003":
        # Negative control: the epoch-less token sequence goes back; the client still works
        # against the 0003 schema (the 0001 functions), and hands out a token twice.
        assert backwards, f"no token went back: old {old[-3:]}, new {new}"
        assert set(new) & set(old), f"no token handed out twice: old {old}, new {new}"
    else:
        assert not backwards, f"tokens went back: old max {max(old)}, new {new}"
        assert min(new) >= pair.timeline(standby) << 40


# --- semaphores and rwlocks ------------------------------------------------------------------


def test_T29_semaphore_and_rwlock_invariants_across_promotion(
    replicated: Callable[..., Replicated], bounds: Bounds
) -> None:
    pair = replicated(sync=True)
    install(pair)
    dsn = pair.conninfo()
    standby = pair.standby
    assert standby is not None
    sem = [pglock.semaphore(dsn, "t29:sem", limit=2, ttl=TTL) for _ in range(3)]
    # check=: after a failover the pool's idle connections are dead; without a check on
    # checkout the first pool_lock/rwlock through each of them fails (OperationalError).
    pool = ConnectionPool(
        dsn, min_size=2, max_size=4, open=True, reset=pglock.reset_connection,
        check=ConnectionPool.check_connection,
    )
    rw = pglock.rwlock(pool, "t29:rw")
    conns: list[psycopg.Connection[Any]] = []
    try:
        a = sem[0].hold(timeout=5)
        b = sem[1].hold(timeout=5)
        pa, pb = a.__enter__(), b.__enter__()
        assert not sem[2].acquire(timeout=0)
        # A reader through the pool, one on a connection; a writer is refused meanwhile.
        conns += [psycopg.connect(dsn, autocommit=True) for _ in range(2)]
        readers = [rw.read(timeout=5), pglock.rwlock(conns[0], "t29:rw").read(timeout=5)]
        for r in readers:
            assert r.acquire()
        assert not pglock.rwlock(conns[1], "t29:rw").write(timeout=0).acquire()

        promoted = pair.failover()

        # Semaphore: both permits survive; never a third; they are renewed on the new primary.
        def renewed_on_new_primary() -> bool:
            with psycopg.connect(standby.dsn(), autocommit=True) as c:
                row = c.execute(
                    "SELECT count(*) FILTER (WHERE acquired_at < expires_at - %s * interval"
                    " '1 second'), count(*) FROM pglock.semaphore_permit"
                    " WHERE semaphore = 't29:sem' AND expires_at > clock_timestamp()",
                    (TTL + 0.001,),
                ).fetchone()
            assert row is not None and row[1] == 2, f"live permits on the new primary: {row}"
            return bool(row[0] == 2)

        assert not sem[2].acquire(timeout=0)
        wait_for(renewed_on_new_primary, timeout=TTL * 3, what="both permits renewed")
        bounds.record("T29", "semaphore", "promotion -> both permits renewed on the new primary",
                      time.monotonic() - promoted)
        pa.check()
        pb.check()
        assert not sem[2].acquire(timeout=0)
        a.__exit__(None, None, None)
        assert sem[2].acquire(timeout=5)
        assert sem[0].count() == 2
        sem[2].release()
        b.__exit__(None, None, None)

        # RWLock: the readers' sessions died with the old primary, and they are told so; a
        # writer then takes the lock on the new primary, alone.
        for r in readers:
            with pytest.raises(pglock.LockLost):
                r.release()
        with rw.write(timeout=10) as conn:
            assert conn.info.port == standby.port
            with psycopg.connect(standby.dsn(), autocommit=True) as obs:
                modes = obs.execute(
                    "SELECT mode FROM pg_locks WHERE locktype = 'advisory' AND granted"
                ).fetchall()
            assert modes == [("ExclusiveLock",)]
            late = psycopg.connect(dsn, autocommit=True)
            conns.append(late)
            assert not pglock.rwlock(late, "t29:rw").read(timeout=0).acquire()
    finally:
        for s in sem:
            s.close()
        pool.close()
        for c in conns:
            c.close()


def test_T29_async_failover_loses_later_grants_and_their_holders_are_told(
    replicated: Callable[..., Replicated], bounds: Bounds
) -> None:
    """What asynchronous replication can lose: a permit and a lease granted after the last
    WAL the standby received. The new primary has no row for them: another client gets the
    permit (the limit is exceeded in the clients' beliefs until the loser is told), and the
    holders' keepalives find their grants gone and report LockLost."""
    pair = replicated(sync=False)
    install(pair)
    dsn = pair.conninfo()
    sem_a = pglock.semaphore(dsn, "t29:lost-sem", limit=1, ttl=TTL)
    # Another client: its own DSN string (its own connections and wait queue).
    sem_b = pglock.semaphore(pair.conninfo(application_name="t29-b"), "t29:lost-sem", limit=1,
                             ttl=TTL)
    with sem_a.hold(timeout=5):
        pass  # the semaphore's row (its limit) reaches the standby
    pair.wait_caught_up()
    pair.cut()
    lost_lease = pglock.lease(dsn, "t29:lost-lease", ttl=TTL, timeout=5)
    assert lost_lease.acquire()
    permit_cm = sem_a.hold(timeout=5)
    permit = permit_cm.__enter__()
    assert pair.lag() > 0
    promoted = pair.failover()
    try:
        # The new primary never saw either grant.
        assert lease_row(pair._standby(), "t29:lost-lease") is None
        assert sem_b.acquire(timeout=5)  # a second permit-holder of a limit of 1
        wait_for(lambda: not permit.locked, timeout=TTL * 2, what="the lost permit reported")
        told = time.monotonic() - promoted
        with pytest.raises(pglock.LockLost):
            permit.check()
        wait_for(lambda: lost_lease.lost, timeout=TTL * 2, what="the lost lease reported")
        with pytest.raises(pglock.LockLost):
            lost_lease.check()
        bounds.record("T29", "async", "promotion -> holder of a lost permit told", told)
        bounds.record("T29", "async", "promotion -> holder of a lost lease told",
                      time.monotonic() - promoted)
        sem_b.release()
    finally:
        with contextlib.suppress(pglock.LockLost):
            permit_cm.__exit__(None, None, None)
        with contextlib.suppress(pglock.LockLost, RuntimeError):
            lost_lease.release()
        sem_a.close()
        sem_b.close()
