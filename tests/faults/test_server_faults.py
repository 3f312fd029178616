"""Server and network faults on a throwaway cluster (never the shared server).

T10 network blackhole, T11 ambiguous acquire, T12 Postgres restart (fast and immediate),
T17 server-side idle timeouts. The cluster has short TCP keepalives (1 s idle, 1 s interval,
2 probes) and tcp_user_timeout 3 s, so that a dead peer is noticed in seconds, as
docs/guarantees.md recommends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import pglock

from .cluster import Cluster
from .conftest import Bounds
from .oracles import holders as holders_of
from .oracles import wait_for, waiters
from .proxy import Proxy
from .waiter import Waiter

CLUSTER_SETTINGS = {
    "tcp_keepalives_idle": 1,
    "tcp_keepalives_interval": 1,
    "tcp_keepalives_count": 2,
    # Keepalives only probe an idle connection: with data unacknowledged (a reply whose ACK
    # the cut swallowed) the kernel retransmits for ~15 min unless tcp_user_timeout is set.
    "tcp_user_timeout": 3000,
    "max_connections": 40,
}

# libpq's side of dead-peer detection (client keepalives, and a bound on unacknowledged data).
CLIENT_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 1,
    "keepalives_interval": 1,
    "keepalives_count": 2,
    "tcp_user_timeout": 3000,
}

Connect = Callable[..., psycopg.Connection[Any]]


def me(conn: psycopg.Connection[Any]) -> int:
    return conn.info.backend_pid


@pytest.fixture
def obs(cluster: Cluster) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(cluster.dsn(), autocommit=True, application_name="pglock-observer") as c:
        yield c


def wait_gone(obs: psycopg.Connection[Any], pid: int, timeout: float = 30) -> None:
    wait_for(
        lambda: (
            obs.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            == (0,)
        ),
        timeout=timeout,
        interval=0.02,
        what=f"backend {pid} to end",
    )


# --- T10: network blackhole -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["session", "xact"])
def test_T10_blackholed_holder(
    kind: str,
    cluster: Cluster,
    cluster_connect: Connect,
    obs: psycopg.Connection[Any],
    name: str,
    kernel_blackhole: None,
    bounds: Bounds,
) -> None:
    """The holder's network goes silent (no FIN, no RST). The server keeps the lock until its
    keepalives give up on the peer, then frees it; the holder learns from its own libpq
    keepalives / tcp_user_timeout and gets LockLost (session) or a connection error (xact)."""
    key = pglock.key(name)
    with Proxy(cluster.port, kernel=True) as proxy:
        holder = cluster_connect(
            dsn=cluster.dsn(port=proxy.port, **CLIENT_KEEPALIVES), autocommit=kind != "xact"
        )
        hpid = me(holder)
        lock = pglock.pg_lock(holder, name)
        if kind == "session":
            assert lock.acquire()
        else:
            pglock.xact_lock(holder, name)
        wconn = cluster_connect()
        w = Waiter(wconn, name, kind)
        wait_for(lambda: me(wconn) in waiters(obs, key), what="the waiter to queue")

        proxy.set_mode("blackhole")
        cut = time.monotonic()
        time.sleep(0.3)
        assert holders_of(obs, key) == [hpid]  # the server cannot know yet: safe, not live
        got = w.join(timeout=30)
        bounds.record(
            "T10",
            kind,
            "waiter got the lock after the holder's network was cut (server keepalives 1+1x2 s)",
            got - cut,
        )
        assert holders_of(obs, key) == [me(wconn)]

        # The holder, still believing, tries to let go: it must learn the truth.
        t0 = time.monotonic()
        if kind == "session":
            with pytest.raises(pglock.LockLost):
                lock.release()
            assert not lock.locked
        else:
            with pytest.raises(psycopg.OperationalError):
                holder.commit()
        bounds.record(
            "T10",
            kind,
            "holder's release reported the loss (its own keepalives had broken the socket)",
            time.monotonic() - t0,
        )
        w.release()
    wait_gone(obs, hpid)


def test_T10_holder_releasing_into_the_blackhole_gets_lock_lost(
    cluster: Cluster,
    cluster_connect: Connect,
    obs: psycopg.Connection[Any],
    name: str,
    kernel_blackhole: None,
    bounds: Bounds,
) -> None:
    """The holder releases just after its network died: the unlock is never acknowledged, and
    libpq's tcp_user_timeout (3 s here) turns the hang into a broken connection: LockLost.
    Without tcp_user_timeout/keepalives on the client the release would hang for the kernel's
    retransmission limit (about 15 min on Linux)."""
    with Proxy(cluster.port, kernel=True) as proxy:
        holder = cluster_connect(dsn=cluster.dsn(port=proxy.port, **CLIENT_KEEPALIVES))
        hpid = me(holder)
        lock = pglock.pg_lock(holder, name)
        assert lock.acquire()
        proxy.set_mode("blackhole")
        t0 = time.monotonic()
        with pytest.raises(pglock.LockLost):
            lock.release()
        bounds.record(
            "T10",
            "session",
            "holder's release into a dead network raised LockLost",
            time.monotonic() - t0,
        )
        assert not lock.locked
    wait_gone(obs, hpid)
    assert holders_of(obs, pglock.key(name)) == []


def test_T11_ambiguous_acquire_reset_after_request(
    cluster: Cluster,
    cluster_connect: Connect,
    obs: psycopg.Connection[Any],
    name: str,
    bounds: Bounds,
) -> None:
    """The acquire reaches the server and is granted, then the connection is reset before the
    answer arrives. The client gets an error, never a lock it does not know about; the server
    ends the session and frees the lock at once."""
    key = pglock.key(name)
    with Proxy(cluster.port) as proxy:
        conn = cluster_connect(dsn=cluster.dsn(port=proxy.port))
        pid = me(conn)
        lock = pglock.pg_lock(conn, name)
        proxy.set_mode("reset_on_response")
        t0 = time.monotonic()
        with pytest.raises((psycopg.OperationalError, pglock.LockError)):
            lock.acquire()
        assert proxy.resets == 1
        assert not lock.locked
        wait_gone(obs, pid)
        rival = cluster_connect()
        assert pglock.pg_lock(rival, name, timeout=5).acquire()
        bounds.record(
            "T11",
            "session",
            "rival got the lock after an ambiguous acquire (reset)",
            time.monotonic() - t0,
        )
        assert holders_of(obs, key) == [me(rival)]
        pglock.pg_lock(rival, name)  # (handle unused)
        rival.execute("SELECT pg_advisory_unlock_all()")


def test_T11_ambiguous_acquire_granted_into_a_blackhole(
    cluster: Cluster,
    cluster_connect: Connect,
    obs: psycopg.Connection[Any],
    name: str,
    kernel_blackhole: None,
    bounds: Bounds,
) -> None:
    """The waiter's network dies while it waits; then the lock is released and Postgres
    grants it to the cut-off waiter, whose answer is lost. The client must end with an error
    (keepalives), and the server must free the orphaned grant once it gives up on the peer."""
    key = pglock.key(name)
    holder = cluster_connect()
    hl = pglock.pg_lock(holder, name)
    assert hl.acquire()
    with Proxy(cluster.port, kernel=True) as proxy:
        conn = cluster_connect(dsn=cluster.dsn(port=proxy.port, **CLIENT_KEEPALIVES))
        pid = me(conn)
        outcome: list[Any] = []
        lock = pglock.pg_lock(conn, name)

        def acquire() -> None:
            try:
                outcome.append(lock.acquire())
            except BaseException as exc:
                outcome.append(exc)

        t = threading.Thread(target=acquire)
        t.start()
        wait_for(lambda: pid in waiters(obs, key), what="the waiter to queue")
        proxy.set_mode("blackhole")
        hl.release()
        released = time.monotonic()
        wait_for(lambda: holders_of(obs, key) == [pid], what="the orphaned grant")
        t.join(30)
        assert outcome and isinstance(outcome[0], (psycopg.OperationalError, pglock.LockError)), (
            outcome
        )
        assert not lock.locked
        bounds.record(
            "T11",
            "session",
            "client learned its acquire failed (keepalives, cut net)",
            time.monotonic() - released,
        )
        wait_for(lambda: holders_of(obs, key) == [], timeout=30, what="the orphaned grant to go")
        bounds.record(
            "T11",
            "session",
            "orphaned grant freed by the server (keepalives 1+1x2 s)",
            time.monotonic() - released,
        )
    assert hl.acquire(timeout=5)
    hl.release()


# --- T12: Postgres restart ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_T12_restart_every_holder_gets_lock_lost(
    mode: str,
    cluster: Cluster,
    cluster_connect: Connect,
    name: str,
    app_name: str,
    bounds: Bounds,
) -> None:
    from psycopg_pool import ConnectionPool

    s_name, x_name, w_name = name + ":s", name + ":x", name + ":w"
    session_conn = cluster_connect()
    session_lock = pglock.pg_lock(session_conn, s_name)
    assert session_lock.acquire()
    xact_conn = cluster_connect(autocommit=False)
    pglock.xact_lock(xact_conn, x_name)
    blocker = cluster_connect()
    bl = pglock.pg_lock(blocker, w_name)
    assert bl.acquire()
    wconn = cluster_connect()
    w = Waiter(wconn, w_name)
    with psycopg.connect(cluster.dsn(), autocommit=True) as obs:
        wait_for(lambda: me(wconn) in waiters(obs, pglock.key(w_name)), what="the waiter to queue")
    pool = ConnectionPool(
        cluster.dsn(),
        min_size=1,
        max_size=2,
        kwargs={"autocommit": True, "application_name": app_name},
        reset=pglock.reset_connection,
        check=ConnectionPool.check_connection,
        open=True,
    )
    try:
        with pglock.pool_lock(pool, name + ":p", timeout=5):
            pass
        t0 = time.monotonic()
        cluster.restart(mode)
        bounds.record("T12", mode, "pg_ctl restart (server back)", time.monotonic() - t0)

        with pytest.raises(pglock.LockLost):
            session_lock.release()
        assert not session_lock.locked
        with pytest.raises(psycopg.OperationalError):
            xact_conn.commit()
        with pytest.raises((psycopg.OperationalError, pglock.LockError)):
            w.join(timeout=30)
        with pytest.raises(pglock.LockLost):
            bl.release()
        # Nothing is silently re-acquired: the new server holds no advisory lock at all.
        with psycopg.connect(cluster.dsn(), autocommit=True) as obs:
            assert obs.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            ).fetchone() == (0,)
        # The pool (check=check_connection) recovers, and locks work again.
        t1 = time.monotonic()
        with pglock.pool_lock(pool, name + ":p", timeout=10) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
        bounds.record("T12", mode, "pool_lock works again after the restart", time.monotonic() - t1)
        # A session pglock knew as dead is refused, not reused.
        with pytest.raises(pglock.InvalidConnectionState):
            pglock.pg_lock(session_conn, s_name).acquire()
    finally:
        pool.close()


# --- T17: idle timeouts end a holder's session ----------------------------------------------------


def test_T17_idle_session_timeout_kills_idle_holder(
    cluster: Cluster,
    cluster_connect: Connect,
    obs: psycopg.Connection[Any],
    name: str,
    bounds: Bounds,
) -> None:
    """A dedicated idle connection holding a session lock is ended by idle_session_timeout:
    the lock is gone, and pglock reports LockLost (never a silent re-acquire)."""
    conn = cluster_connect(options="-c idle_session_timeout=1000")
    pid = me(conn)
    lock = pglock.pg_lock(conn, name)
    assert lock.acquire()
    t0 = time.monotonic()
    wait_gone(obs, pid, timeout=15)
    bounds.record(
        "T17", "session", "idle holder ended by idle_session_timeout=1s", time.monotonic() - t0
    )
    assert holders_of(obs, pglock.key(name)) == []
    with pytest.raises(pglock.LockLost):
        lock.release()
    assert not lock.locked


def test_T17_idle_in_transaction_timeout_kills_xact_holder(
    cluster: Cluster,
    cluster_connect: Connect,
    obs: psycopg.Connection[Any],
    name: str,
    bounds: Bounds,
) -> None:
    conn = cluster_connect(autocommit=False, options="-c idle_in_transaction_session_timeout=1000")
    pid = me(conn)
    pglock.xact_lock(conn, name)
    conn.execute("CREATE TEMP TABLE t17 (v int)")
    t0 = time.monotonic()
    wait_gone(obs, pid, timeout=15)
    bounds.record(
        "T17", "xact", "idle-in-transaction holder ended (timeout 1 s)", time.monotonic() - t0
    )
    assert holders_of(obs, pglock.key(name)) == []
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):  # 25P03
        conn.commit()
    with pytest.raises(pglock.InvalidConnectionState):
        pglock.xact_lock(conn, name)
