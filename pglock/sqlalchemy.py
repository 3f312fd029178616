"""SQLAlchemy integration: release advisory locks when a pooled connection is checked in.

:func:`pglock.pg_lock`, :func:`pglock.xact_lock` and :func:`pglock.try_xact_lock` accept a
SQLAlchemy ``Connection`` or an ORM ``Session`` directly, and :func:`pglock.pool_lock` an
``Engine``. What is supported:

========================================  ==================================================
``postgresql+psycopg://`` (psycopg 3)      supported: Engine, Connection, Session
other PostgreSQL drivers (psycopg2,        ``TypeError``: pglock talks to the psycopg 3
pg8000, asyncpg, ...), other databases     connection underneath
``AsyncEngine``, ``AsyncConnection``,      ``TypeError``: pglock is synchronous
``AsyncSession``
========================================  ==================================================

The safety net for pooled connections is :func:`release_on_checkin`: it hooks the pool's
``reset`` event (SQLAlchemy 2.0+) so that a connection returned to the pool holding an
advisory lock (taken by raw SQL, or a ``pg_lock`` block that was never left) has it released,
with a WARNING naming the keys, before anyone else can check it out.

For ORM code, :func:`locked_session` holds a session lock around a ``Session`` whose commits
do not give the connection (and the lock) back to the pool.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import psycopg
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import Pool, PoolResetState

from ._classify import Kind, check_driver, classify
from ._conn import IDLE, INERROR
from ._pool import PoolLock, release_all

__all__ = ["locked_session", "release_on_checkin"]

logger = logging.getLogger("pglock.sqlalchemy")

_MARK = "_pglock_release_on_checkin"


def _on_reset(dbapi_connection: Any, connection_record: Any, reset_state: PoolResetState) -> None:
    if reset_state.terminate_only or not reset_state.asyncio_safe:
        return  # the connection is being closed: Postgres drops its locks
    raw = getattr(connection_record, "driver_connection", None) or dbapi_connection
    if not isinstance(raw, psycopg.Connection) or raw.closed or raw.broken:
        return
    status = raw.info.transaction_status
    if status == INERROR:
        raw.rollback()  # the pool rolls back next anyway; nothing can run before that
        status = IDLE
    # In an open transaction the statement runs inside it (session locks are released at
    # once all the same) and the pool's own reset ends it; if the connection was idle, end
    # the transaction our statement began. An exception here makes SQLAlchemy invalidate
    # the connection: it is never checked out again holding a lock.
    release_all(raw, source="SQLAlchemy pool reset", end_own_transaction=status == IDLE)


def release_on_checkin(engine_or_pool: Engine | Pool) -> None:
    """Release every advisory lock a pooled connection still holds when it goes back to the
    pool: the SQLAlchemy counterpart of :func:`pglock.reset_connection`.

    Listens to the pool's ``reset`` event (SQLAlchemy 2.0+), which runs on every return to the
    pool (``Connection.close()``, the end of ``with engine.connect()``, ``Session.close()``)
    and for detached connections. One statement lists the session's advisory locks and calls
    ``pg_advisory_unlock_all()``; leaked keys are logged at WARNING on ``pglock.pool``. If it
    fails, SQLAlchemy invalidates the connection instead of pooling it. Calling it again for
    the same engine does nothing.

    :param engine_or_pool: a SQLAlchemy ``Engine`` (psycopg driver) or its ``Pool``.
    :raises TypeError: not an ``Engine`` or ``Pool``, or an engine with another driver.

    Example::

        engine = sqlalchemy.create_engine("postgresql+psycopg://app@db/app")
        pglock.sqlalchemy.release_on_checkin(engine)
    """
    kind = classify(
        engine_or_pool,
        (Kind.ENGINE, Kind.SA_POOL),
        api="release_on_checkin",
        hints=dict.fromkeys(Kind, "pass the Engine or Pool that hands out the connections"),
    )
    if kind is Kind.ENGINE:
        engine = cast(Engine, engine_or_pool)
        check_driver(engine.dialect)
        target: Pool = engine.pool
    else:
        target = cast(Pool, engine_or_pool)
    # A mark on the pool itself, not event.contains(): SQLAlchemy's registry is keyed by id(),
    # and a new pool that reuses a disposed one's id can look hooked when it is not.
    if not getattr(target, _MARK, False):
        event.listen(target, "reset", _on_reset)
        setattr(target, _MARK, True)


def locked_session(
    engine: Engine,
    names: str | Sequence[str],
    *,
    shared: bool = False,
    timeout: float | None = None,
    session_factory: Callable[..., Session] = Session,
) -> contextlib.AbstractContextManager[Session]:
    """An ORM ``Session`` on a connection that holds a session advisory lock.

    ``with locked_session(engine, "invoice:42") as session:`` checks a connection out of
    ``engine`` and locks it as :func:`pglock.pool_lock` does, then yields a ``Session`` bound to
    that connection. The body's work is committed at the end of the block (rolled back if it
    raised), while the lock is still held; the body may also commit on its own. Because the
    Session is bound to one connection, ``session.commit()`` does not return the connection,
    and so the lock, to the pool, as it would for a Session bound to the engine.

    :param session_factory: a ``Session`` subclass or a ``sessionmaker``; called as
        ``session_factory(bind=connection)``.
    :raises pglock.LockNotAcquired: not acquired within ``timeout``.
    :raises TypeError: ``engine`` is not a psycopg Engine; bad names or timeout.

    Example::

        with pglock.sqlalchemy.locked_session(engine, "invoice:42", timeout=5) as session:
            session.get(Invoice, 42).sent = True
    """
    lock = PoolLock(engine, names, shared=shared, timeout=timeout)
    if not callable(session_factory):
        raise TypeError("session_factory must be a Session class or a sessionmaker")
    return _locked_session(lock, session_factory)


@contextlib.contextmanager
def _locked_session(lock: PoolLock, session_factory: Callable[..., Session]) -> Iterator[Session]:
    with lock as conn:
        session = session_factory(bind=conn)
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()
