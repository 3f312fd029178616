"""SQLAlchemy integration: release advisory locks when a pooled connection is checked in, and
hold a lock around an ORM ``Session``. Which engines and drivers are supported: docs/sqlalchemy.md.
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
from ._pool import PoolLock, reset

__all__ = ["locked_session", "release_on_checkin"]

logger = logging.getLogger("pglock.sqlalchemy")

_MARK = "_pglock_release_on_checkin"


def _on_reset(dbapi_connection: Any, connection_record: Any, reset_state: PoolResetState) -> None:
    if reset_state.terminate_only or not reset_state.asyncio_safe:
        return  # the connection is being closed: Postgres drops its locks
    raw = getattr(connection_record, "driver_connection", None) or dbapi_connection
    if not isinstance(raw, psycopg.Connection) or raw.closed or raw.broken:
        return
    # An exception here makes SQLAlchemy invalidate the connection: it is never checked out
    # again holding a lock.
    reset(raw, "SQLAlchemy pool reset")


def release_on_checkin(engine_or_pool: Engine | Pool) -> None:
    """Release every advisory lock a pooled connection still holds when it goes back to the
    pool: the SQLAlchemy counterpart of :func:`pglock.reset_connection`.

    Hooks the pool's ``reset`` event (SQLAlchemy 2.0+); leaked keys are logged at WARNING on
    ``pglock.pool``, and a connection whose release fails is invalidated, never pooled. Calling
    it again for the same engine does nothing.

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

    Locks a connection of ``engine`` as :func:`pglock.pool_lock` does and yields a ``Session``
    bound to it, so that ``session.commit()`` keeps the connection and the lock. The block's
    work is committed at its end (rolled back if it raised), while the lock is still held.

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
