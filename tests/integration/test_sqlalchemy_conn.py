"""pg_lock / xact_lock with SQLAlchemy Connections and ORM Sessions (psycopg driver)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from _pgdb import sa_url
from _truth import held
from sqlalchemy.orm import Session

import pglock

Connect = Callable[..., psycopg.Connection[Any]]


def xk(name: str) -> tuple[int, str]:
    return (pglock.key(name), "ExclusiveLock")


def app_pids(observer: psycopg.Connection[Any], app_name: str) -> list[int]:
    rows = observer.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app_name,)
    ).fetchall()
    return [r[0] for r in rows]


def pid_of(sa_conn: sa.Connection) -> int:
    raw = sa_conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw.info.backend_pid


def test_orm_session_begin_xact_lock(engine: sa.Engine, other: Any, name: str) -> None:
    with Session(engine) as session:
        with session.begin():
            pglock.xact_lock(session, name)
            pid = pid_of(session.connection())
            assert held(other, pid) == [xk(name)]
            session.execute(sa.text("SELECT 1"))
            assert pglock.try_xact_lock(session, name)  # re-taken in the same transaction
        assert held(other, pid) == []
        with session.begin():
            pglock.xact_lock(session, name, timeout=1)
            assert held(other, pid_of(session.connection())) == [xk(name)]
            session.rollback()
        assert held(other, pid) == []


def test_orm_session_begin_with_rival(engine: sa.Engine, other: Any, name: str) -> None:
    with Session(engine) as s1, Session(engine) as s2:
        with s1.begin():
            pglock.xact_lock(s1, name)
            with s2.begin():
                assert pglock.try_xact_lock(s2, name) is False
                with pytest.raises(pglock.LockNotAcquired):
                    pglock.xact_lock(s2, name, timeout=0.2)
                s2.execute(sa.text("SELECT 1"))  # the session's transaction is usable
        with s2.begin():
            assert pglock.try_xact_lock(s2, name)


def test_orm_session_autobegin_then_commit(engine: sa.Engine, other: Any, name: str) -> None:
    with Session(engine) as session:
        pglock.xact_lock(session, name)  # autobegin
        pid = pid_of(session.connection())
        assert held(other, pid) == [xk(name)]
        session.commit()
        assert held(other, pid) == []


def test_orm_session_pg_lock(engine: sa.Engine, other: Any, name: str) -> None:
    with Session(engine) as session:
        session.execute(sa.text("SELECT 1"))
        pid = pid_of(session.connection())
        with pglock.pg_lock(session, name, timeout=1):
            assert held(other, pid) == [xk(name)]
            session.execute(sa.text("SELECT 2"))
        assert held(other, pid) == []
        session.commit()


def test_orm_session_pg_lock_lost_when_session_gives_its_connection_back(
    engine: sa.Engine, other: Any, name: str
) -> None:
    """A session lock lives on the Session's current connection; session.commit() hands that
    connection back to the engine's pool (here a NullPool, which closes it): the lock is gone,
    and the end of the block says so instead of pretending."""
    with Session(engine) as session:
        with pytest.raises(pglock.LockLost), pglock.pg_lock(session, name):
            pid = pid_of(session.connection())
            session.commit()
        # The closed connection's backend exits a moment later, and its locks with it.
        end = time.monotonic() + 10
        while held(other, pid) and time.monotonic() < end:
            time.sleep(0.01)
        assert held(other, pid) == []


def test_sqlalchemy_connection_pg_lock(engine: sa.Engine, other: Any, name: str) -> None:
    with engine.connect() as sc:
        pid = pid_of(sc)
        with pglock.pg_lock(sc, name):
            assert held(other, pid) == [xk(name)]
            raw = sc.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
            assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert held(other, pid) == []
        # Inside SQLAlchemy's transaction, with work done before.
        with sc.begin():
            sc.execute(sa.text("SELECT 1"))
            with pglock.pg_lock(sc, name, timeout=1):
                assert held(other, pid) == [xk(name)]
            sc.execute(sa.text("SELECT 2"))
        assert held(other, pid) == []


def test_sqlalchemy_connection_xact_lock(engine: sa.Engine, other: Any, name: str) -> None:
    with engine.connect() as sc:
        pid = pid_of(sc)
        with sc.begin():
            pglock.xact_lock(sc, name)
            assert held(other, pid) == [xk(name)]
        assert held(other, pid) == []
        # No explicit begin: pglock begins SQLAlchemy's transaction (autobegin) and the lock
        # lasts until that transaction ends.
        pglock.xact_lock(sc, name, timeout=1)
        assert sc.in_transaction()
        assert held(other, pid) == [xk(name)]
        sc.rollback()
        assert held(other, pid) == []


def test_sqlalchemy_autocommit_connection_xact_lock_refused(
    engine: sa.Engine, other: Any, name: str
) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as sc:
        with pytest.raises(pglock.InvalidConnectionState, match="open transaction"):
            pglock.xact_lock(sc, name)
        assert held(other, pid_of(sc)) == []


def test_engine_refused(engine: sa.Engine, name: str) -> None:
    with pytest.raises(TypeError, match="Engine"):
        pglock.pg_lock(engine, name)
    with pytest.raises(TypeError, match="Engine"):
        pglock.xact_lock(engine, name)


def test_psycopg2_engine_refused(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    eng = sa.create_engine(
        sa_url(pg_dsn, "psycopg2"),
        connect_args={"application_name": app_name},
        poolclass=sa.NullPool,
    )
    try:
        with eng.connect() as sc:
            with pytest.raises(TypeError, match="psycopg2"):
                pglock.pg_lock(sc, name)
            with pytest.raises(TypeError, match="psycopg2"):
                pglock.xact_lock(sc, name)
            with Session(bind=sc) as session, pytest.raises(TypeError, match="psycopg2"):
                pglock.try_xact_lock(session, name)
        with pytest.raises(TypeError):
            pglock.pg_lock(eng, name)
    finally:
        eng.dispose()


def test_async_engine_refused(pg_dsn: str, app_name: str, name: str) -> None:
    pytest.importorskip("greenlet", reason="SQLAlchemy's asyncio needs greenlet")
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    eng = create_async_engine(sa_url(pg_dsn), connect_args={"application_name": app_name})
    for obj in (eng, AsyncSession(eng)):
        with pytest.raises(TypeError, match="synchronous"):
            pglock.pg_lock(obj, name)
        with pytest.raises(TypeError, match="synchronous"):
            pglock.xact_lock(obj, name)
    # No connection was ever opened: nothing to dispose.


def test_sync_sqlalchemy_works_without_greenlet(pg_dsn: str, app_name: str, name: str) -> None:
    """SQLAlchemy 2.1 makes greenlet optional: pglock must not import sqlalchemy.ext.asyncio."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["greenlet"] = None  # as if not installed
        import sqlalchemy as sa
        from sqlalchemy.orm import Session
        import pglock
        eng = sa.create_engine({str(sa_url(pg_dsn))!r}, poolclass=sa.NullPool,
                               connect_args={{"application_name": {app_name!r}}})
        with Session(eng) as s, s.begin():
            pglock.xact_lock(s, {name!r})
        print("ok", "sqlalchemy.ext.asyncio" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "False"]


def test_session_subclass_accepted(engine: sa.Engine, other: Any, name: str) -> None:
    class MySession(Session):
        pass

    with MySession(engine) as session, session.begin():
        pglock.xact_lock(session, name)
        assert held(other, pid_of(session.connection())) == [xk(name)]


def test_unbound_session_refused(name: str) -> None:
    with Session() as session, pytest.raises(TypeError, match="bind"):
        pglock.pg_lock(session, name)


def test_closed_sqlalchemy_connection_refused(engine: sa.Engine, name: str) -> None:
    sc = engine.connect()
    sc.close()
    with pytest.raises((pglock.InvalidConnectionState, TypeError)):
        pglock.pg_lock(sc, name)


def test_multi_name_through_session(engine: sa.Engine, other: Any) -> None:
    names = [f"test:{uuid.uuid4()}" for _ in range(3)]
    with Session(engine) as session, session.begin():
        pglock.xact_lock(session, names)
        assert held(other, pid_of(session.connection())) == sorted(xk(n) for n in names)
