"""No grant held by nobody (issue 14, item 4): a semaphore or lease acquire whose answer is
lost after it committed on the server leaves no permit or lease held by nobody.

Every attempt of one acquisition sends the same holder id (a request id). A fault proxy on the
shared server loses the acquire's answer: reset after the request ran (the statement is sent
once more on a new connection), or dropped (the client cuts the statement off at its deadline).
The oracle is the ``semaphore_permit`` table: exactly the permits asked for, held by the
handle's holder id, while held; none after the release, and none when the acquisition gave up.
The negative control replays the same fault with the old per-attempt holder ids in SQL: the
first grant stays held by a holder id nobody knows. A lease keeps one holder id per handle (a
resend is a re-entrant acquire); one that gives up after a lost answer looks for a grant to its
holder id and releases it (the oracle is the ``lease`` table).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import own_schema
from _threads import started
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pglock
from pglock import _sql

from .conftest import Bounds
from .proxy import Proxy


@pytest.fixture(scope="module")
def schema(pg_dsn: str) -> Iterator[str]:
    """A pglock schema of this module's own (other modules install and drop the default)."""
    with own_schema(pg_dsn, prefix="t14sem") as name:
        yield name


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[Proxy]:
    params = conninfo_to_dict(pg_dsn)
    upstream_host = str(params.get("host") or "127.0.0.1")  # a TCP host or a socket directory
    with Proxy(int(params.get("port") or 5432), upstream_host=upstream_host) as p:
        yield p


@pytest.fixture
def proxied(pg_dsn: str, proxy: Proxy, app_name: str) -> str:
    """The DSN of the shared server through the proxy."""
    return make_conninfo(pg_dsn, host="127.0.0.1", port=proxy.port, application_name=app_name)


def permit_rows(obs: psycopg.Connection[Any], schema: str, name: str) -> list[tuple[Any, ...]]:
    """Every permit row of ``name`` (live or not): (holder, permits)."""
    return obs.execute(
        sql.SQL("SELECT holder, permits FROM {}.semaphore_permit WHERE semaphore = %s"
                " ORDER BY holder").format(sql.Identifier(schema)), (name,)
    ).fetchall()


def wait_until(pred: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("limit", "permits"), [(2, 1), (1, 1), (3, 2)],
    # The resend fails on its own (semaphore, holder) key when a second copy would fit; else
    # the first send's row is what refuses it.
    ids=["duplicate-fits", "own-row-fills-it", "weighted-own-row-fills-it"],
)
def test_a_lost_answer_then_a_resend_holds_exactly_the_permits_asked_for(
    limit: int, permits: int, proxied: str, proxy: Proxy, schema: str, name: str,
    observer: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, bounds: Bounds,
) -> None:
    caplog.set_level(logging.INFO, logger="pglock.semaphore")
    sem = pglock.semaphore(proxied, name, limit, ttl=60, schema=schema)
    try:
        assert sem.count() == 0  # the source's connection is open before the fault
        proxy.set_mode("reset_on_response", times=1)
        t0 = time.monotonic()
        with sem.hold(permits=permits, timeout=10) as permit:
            bounds.record("T11", "semaphore", f"acquire whose answer was reset held its own "
                          f"grant ({limit=}, {permits=})", time.monotonic() - t0)
            assert proxy.resets == 1  # not vacuous: the first answer was lost
            assert permit_rows(observer, schema, name) == [(permit.holder, permits)]
            assert sem.count() == permits
            permit.check()
        assert permit_rows(observer, schema, name) == []
        adopted = [r for r in caplog.records if "whose answer was lost had been granted" in
                   r.getMessage()]
        assert len(adopted) == 1, [r.getMessage() for r in caplog.records]
    finally:
        sem.close()


def test_giving_up_after_a_lost_answer_leaves_no_permit(
    proxied: str, proxy: Proxy, schema: str, name: str, observer: psycopg.Connection[Any],
    bounds: Bounds,
) -> None:
    """The acquire commits but its answer is dropped: the client cuts the statement off at its
    deadline (timeout + 1 s), gives up, and releases its holder id."""
    sem = pglock.semaphore(proxied, name, 2, ttl=60, schema=schema)
    try:
        assert sem.count() == 0
        proxy.set_mode("drop_responses")
        t0 = time.monotonic()
        join = started(lambda: sem.acquire(timeout=0.5))
        wait_until(lambda: len(permit_rows(observer, schema, name)) == 1 and proxy.dropped,
                   "the grant to commit and its answer to be dropped")
        proxy.set_mode("pass")  # the release that giving up sends gets through
        assert join() is False
        bounds.record("T11", "semaphore", "acquire(timeout=0.5) whose answer was dropped gave "
                      "up and released its grant", time.monotonic() - t0)
        assert permit_rows(observer, schema, name) == []
        assert sem.count() == 0
    finally:
        sem.close()


def test_an_error_after_a_lost_answer_leaves_no_permit(
    proxied: str, proxy: Proxy, schema: str, name: str, observer: psycopg.Connection[Any],
) -> None:
    """The acquire commits and its answer is lost; the resend's new connection is reset too,
    so the acquire fails with that error, after releasing its holder id."""
    sem = pglock.semaphore(proxied, name, 2, ttl=60, schema=schema)
    try:
        assert sem.count() == 0
        proxy.set_mode("reset_on_response", times=2)
        with pytest.raises(psycopg.OperationalError):
            sem.acquire(timeout=5)
        assert proxy.resets == 2
        assert permit_rows(observer, schema, name) == []
    finally:
        sem.close()


def test_negative_control_per_attempt_holder_ids_orphan_the_first_grant(
    proxied: str, proxy: Proxy, schema: str, name: str, observer: psycopg.Connection[Any],
) -> None:
    """The same fault with a new holder id per attempt (what pglock sent before issue 14):
    the first send committed, the resend is granted a second permit, and the first stays held
    by a holder id nobody knows until its TTL. Sent again with the same id it is found."""
    def acquire(conn: psycopg.Connection[Any], holder: str) -> Any:
        stmt = _sql.semaphore_acquire(schema, name, 2, holder, 1, 60.0, None, False)
        cur = conn.execute(stmt)  # BEGIN; SET ...; SELECT ...; COMMIT: the SELECT's result
        while cur.description is None:
            assert cur.nextset()
        return cur.fetchone()

    first, second = (f"control:{uuid.uuid4().hex}" for _ in range(2))
    with psycopg.connect(proxied, autocommit=True) as conn:
        proxy.set_mode("reset_on_response", times=1)
        with pytest.raises(psycopg.OperationalError):
            acquire(conn, first)
    assert proxy.resets == 1
    assert permit_rows(observer, schema, name) == [(first, 1)]  # committed, answer lost
    with psycopg.connect(proxied, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UniqueViolation):
            acquire(conn, first)  # the request id: the earlier grant is found
        conn.rollback()
        assert permit_rows(observer, schema, name) == [(first, 1)]
        row = acquire(conn, second)  # per attempt: a second permit
        assert row is not None and row[0] is True
    assert permit_rows(observer, schema, name) == sorted([(first, 1), (second, 1)])
    # Held by nobody: no handle knows ``first``; only its TTL (60 s) would free it.
    for holder in (first, second):
        observer.execute(sql.SQL("SELECT {}.semaphore_release(%s, %s)").format(
            sql.Identifier(schema)), (name, holder))


def live_lease_holders(obs: psycopg.Connection[Any], schema: str, name: str) -> list[str]:
    return [r[0] for r in obs.execute(
        sql.SQL("SELECT holder FROM {}.lease WHERE name = %s AND expires_at > clock_timestamp()")
        .format(sql.Identifier(schema)), (name,)
    ).fetchall()]


@pytest.mark.parametrize("timeout", [0, 0.5])
def test_a_lease_acquire_that_gives_up_after_a_lost_answer_releases_its_grant(
    timeout: float, proxied: str, proxy: Proxy, schema: str, name: str,
    observer: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, bounds: Bounds,
) -> None:
    """The grant commits and its answer is dropped: the client cuts the statement off at its
    deadline (timeout + 1 s), says False, and releases the grant its holder id was given,
    instead of leaving the lease with nobody for its TTL (60 s here)."""
    caplog.set_level(logging.INFO, logger="pglock")
    lease = pglock.lease(proxied, name, ttl=60, schema=schema)
    try:
        assert lease.acquire(timeout=0)  # the handle's source is connected before the fault
        lease.release()
        proxy.set_mode("drop_responses")
        t0 = time.monotonic()
        join = started(lambda: lease.acquire(timeout=timeout))
        wait_until(lambda: live_lease_holders(observer, schema, name) == [lease.holder]
                   and proxy.dropped, "the grant to commit and its answer to be dropped")
        proxy.set_mode("pass")  # what giving up sends gets through
        assert join() is False
        bounds.record("T11", "lease", f"acquire(timeout={timeout}) whose answer was dropped "
                      "gave up and released its grant", time.monotonic() - t0)
        assert live_lease_holders(observer, schema, name) == []
        assert any("whose answer was lost" in r.getMessage() for r in caplog.records)
        other = pglock.lease(proxied, name, ttl=5, schema=schema)
        assert other.acquire(timeout=0)  # free at once, not after 60 s
        other.release()
    finally:
        lease.close()
