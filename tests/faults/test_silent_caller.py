"""A lock attempt with a timeout on the caller's connection gives up when the path to the
database goes silent (issue 11: a client-side deadline on every statement pglock sends).

The server answers a timed attempt by its ``lock_timeout``; with no answer by the timeout
plus ``pglock._conn.CALLER_ANSWER_GRACE`` (a silent network, a stalled server), pglock cuts the
connection off: the attempt raises ``psycopg.OperationalError`` and the connection is closed
(its session, and any lock it held, ends once the server notices). Before, the attempt
waited for TCP to give up (about 15 minutes with the kernel's defaults).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pglock
from pglock import _conn

from .conftest import Bounds
from .proxy import Proxy


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[Proxy]:
    params = conninfo_to_dict(pg_dsn)
    # The server's TCP host, or its socket directory (the embedded server listens on a socket
    # only): the proxy forwards to either, and the caller reaches the proxy over TCP.
    upstream_host = str(params.get("host") or "127.0.0.1")
    with Proxy(int(params.get("port") or 5432), upstream_host=upstream_host) as p:
        yield p


def _attempt(call: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``call`` in a thread (joined for at most 30 s); its result or exception, and how
    long it took."""
    out: list[Any] = []
    t0 = time.monotonic()

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)  # a generous bound: the measured figure is recorded
    assert not thread.is_alive(), "the lock attempt was still blocked 30 s later"
    return out[0], time.monotonic() - t0


@pytest.mark.parametrize(
    ("kind", "timeout"),
    [("pg_lock", 0), ("pg_lock", 1), ("pg_lock-two-names", 1), ("xact_lock", 1)],
)
def test_a_timed_attempt_into_a_silent_network_gives_up(
    pg_dsn: str,
    app_name: str,
    name: str,
    proxy: Proxy,
    connect: Callable[..., psycopg.Connection[Any]],
    bounds: Bounds,
    kind: str,
    timeout: float,
) -> None:
    holder = connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))
    via_proxy = make_conninfo(
        pg_dsn, host="127.0.0.1", hostaddr="127.0.0.1", port=proxy.port,
        application_name=app_name,
    )
    caller = psycopg.connect(via_proxy, autocommit=kind != "xact_lock")
    pid = caller.info.backend_pid
    try:
        with pglock.pg_lock(caller, f"{name}:warm"):  # the connection's probe is done
            pass
        if kind == "xact_lock":
            caller.commit()
        proxy.set_mode("blackhole")

        def call() -> Any:
            if kind == "xact_lock":
                return pglock.xact_lock(caller, name, timeout=timeout)
            names = [name, f"{name}:b"] if kind == "pg_lock-two-names" else name
            return pglock.pg_lock(caller, names, timeout=timeout).acquire()

        result, took = _attempt(call)
        assert isinstance(result, psycopg.OperationalError), result
        assert "no answer" in str(result)
        assert caller.closed
        assert took >= timeout
        bounds.record(
            "T10", "session" if kind != "xact_lock" else "xact",
            f"{kind}(timeout={timeout:g}) into a silent network gave up "
            f"(answer grace {_conn.CALLER_ANSWER_GRACE:g} s)",
            took,
        )
    finally:
        caller.close()
        proxy.set_mode("pass")
        proxy.reset_all()  # the server now sees the caller's session end
        _wait_gone(holder, pid)
        holder.execute("SELECT pg_advisory_unlock_all()")


def _wait_gone(observer: psycopg.Connection[Any], pid: int, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while observer.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
        assert time.monotonic() < deadline, f"backend {pid} did not end"
        time.sleep(0.02)


def test_a_wait_without_timeout_is_not_cut_off(
    pg_dsn: str, app_name: str, name: str, proxy: Proxy,
    connect: Callable[..., psycopg.Connection[Any]],
) -> None:
    """Negative control: ``timeout=None`` has no deadline; the wait outlasts the grace and is
    granted after the release."""
    holder = connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))
    via_proxy = make_conninfo(
        pg_dsn, host="127.0.0.1", hostaddr="127.0.0.1", port=proxy.port,
        application_name=app_name,
    )
    with psycopg.connect(via_proxy, autocommit=True) as caller:
        release = threading.Timer(
            _conn.CALLER_ANSWER_GRACE + 1, lambda: holder.execute("SELECT pg_advisory_unlock_all()")
        )
        release.start()
        try:
            lock = pglock.pg_lock(caller, name)
            assert lock.acquire()
            lock.release()
        finally:
            release.cancel()
            release.join()
        assert not caller.closed
