"""``timeout=None`` waits until acquired, whatever the session's own timeouts say.

A role with ``ALTER ROLE app SET statement_timeout = '300ms'`` (and ``lock_timeout``) is a
common set-up; pglock overrides both, scoped to its own statement, for a wait without a
timeout, and leaves them as they were. A cancel still ends such a wait (issue 11 item 10).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import with_params
from _truth import held
from psycopg import sql

import pglock

HOLD = 0.9  # how long the other session keeps the name: well past the role's 300 ms


@pytest.fixture
def role_dsn(pg_dsn: str, app_name: str) -> Iterator[str]:
    """A login role whose sessions get statement_timeout and lock_timeout of 300 ms."""
    role = f"pglock_t10_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        for setting in ("statement_timeout", "lock_timeout"):
            admin.execute(
                sql.SQL("ALTER ROLE {} SET {} = '300ms'").format(
                    sql.Identifier(role), sql.Identifier(setting)
                )
            )
        try:
            yield with_params(pg_dsn, user=role, application_name=app_name)
        finally:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def hold_for(
    connect: Callable[..., psycopg.Connection[Any]], names: list[str], secs: float
) -> None:
    """Another session takes ``names`` now and releases them after ``secs`` seconds."""
    holder = connect()
    for n in names:
        holder.execute("SELECT pg_advisory_lock(%s)", (pglock.key(n),))
    threading.Timer(secs, lambda: holder.execute("SELECT pg_advisory_unlock_all()")).start()


def exclusive(name: str) -> tuple[int, str]:
    return (pglock.key(name), "ExclusiveLock")


def settings(c: psycopg.Connection[Any]) -> tuple[Any, ...]:
    row = c.execute("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')")
    return tuple(row.fetchone() or ())


@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transactional"])
@pytest.mark.parametrize("several", [False, True], ids=["one-name", "two-names"])
def test_pg_lock_without_timeout_outlasts_the_roles_timeouts(
    role_dsn: str,
    connect: Callable[..., psycopg.Connection[Any]],
    other: psycopg.Connection[Any],
    autocommit: bool,
    several: bool,
) -> None:
    names = [f"test:{uuid.uuid4()}" for _ in range(2 if several else 1)]
    c = psycopg.connect(role_dsn, autocommit=autocommit)
    try:
        assert settings(c) == ("300ms", "300ms")
        if not autocommit:
            c.rollback()
        hold_for(connect, names, HOLD)
        with pglock.pg_lock(c, names):  # waits for the release, not 300 ms
            assert held(other, c.info.backend_pid) == sorted(map(exclusive, names))
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert settings(c) == ("300ms", "300ms")  # the session's settings are unchanged
    finally:
        c.close()


def test_xact_lock_without_timeout_outlasts_the_roles_timeouts(
    role_dsn: str, connect: Callable[..., psycopg.Connection[Any]], other: psycopg.Connection[Any]
) -> None:
    name = f"test:{uuid.uuid4()}"
    with psycopg.connect(role_dsn) as c:
        hold_for(connect, [name], HOLD)
        with c.transaction():
            pglock.xact_lock(c, name)
            assert held(other, c.info.backend_pid) == [exclusive(name)]
            # Restored inside the caller's transaction, not only at its end.
            assert settings(c) == ("300ms", "300ms")
            assert c.execute("SELECT 1").fetchone() == (1,)


def test_a_set_after_the_first_use_is_outlasted_too(
    conn: psycopg.Connection[Any],
    connect: Callable[..., psycopg.Connection[Any]],
    other: psycopg.Connection[Any],
    name: str,
) -> None:
    with pglock.pg_lock(conn, f"{name}:first"):  # pglock has probed the session: no timeouts
        pass
    conn.execute("SET statement_timeout = '300ms'")
    hold_for(connect, [name], HOLD)
    with pglock.pg_lock(conn, name):
        assert held(other, conn.info.backend_pid) == [exclusive(name)]
    hold_for(connect, [name], HOLD)
    with conn.transaction():
        pglock.xact_lock(conn, name)
        assert held(other, conn.info.backend_pid) == [exclusive(name)]
    assert settings(conn) == ("300ms", "0")


def test_a_cancel_still_ends_a_wait_without_timeout(
    role_dsn: str, connect: Callable[..., psycopg.Connection[Any]], other: psycopg.Connection[Any]
) -> None:
    """The override is pglock's own: a cancel (pg_cancel_backend, conn.cancel()) stands."""
    name = f"test:{uuid.uuid4()}"
    holder = connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))
    with psycopg.connect(role_dsn, autocommit=True) as c:
        timer = threading.Timer(HOLD, c.cancel_safe)
        timer.start()
        try:
            with pytest.raises(pglock.LockNotAcquired), pglock.pg_lock(c, name):
                pytest.fail("the body ran")
        finally:
            timer.cancel()
            holder.execute("SELECT pg_advisory_unlock_all()")
        assert held(other, c.info.backend_pid) == []
        assert settings(c) == ("300ms", "300ms")
