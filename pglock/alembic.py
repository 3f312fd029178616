"""Alembic integration: serialize concurrent ``alembic upgrade`` runs with an advisory lock.

Why a dedicated connection and polling waiters, and the ``env.py`` snippet: docs/alembic.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import psycopg
from psycopg.conninfo import make_conninfo

from ._advisory import PgLock
from ._classify import Kind, classify, dsn
from ._conn import validate_pooler
from ._deadline import connect_extra
from ._keys import validate_name, validate_timeout
from .errors import LockNotAcquired

__all__ = ["migration_lock"]

logger = logging.getLogger("pglock.alembic")

#: Polling between attempts, seconds: from the first to the last interval, doubling.
_FIRST_POLL = 0.05
_MAX_POLL = 1.0


def migration_lock(
    connection_or_url: object, name: str = "alembic-migrations", *, timeout: float | None = None,
    pooler: str = "auto",
) -> contextlib.AbstractContextManager[None]:
    """Hold a session advisory lock on a dedicated connection while migrations run.

    Use it around the migration run in ``env.py`` (``run_migrations_online``)::

        with migration_lock(connectable, timeout=600):
            with connectable.connect() as connection:
                context.configure(connection=connection, target_metadata=target_metadata)
                with context.begin_transaction():
                    context.run_migrations()

    Take the lock before opening the migration connection, so that a process that waits has
    not read the current revision yet. Waiters poll (50 ms growing to 1 s) rather than block,
    so that they hold no snapshot that ``CREATE INDEX CONCURRENTLY`` would wait for.

    :param connection_or_url: where to open the dedicated connection: a SQLAlchemy ``Engine``,
        ``Connection`` or ``URL``, or a URL / libpq connection string (docs/alembic.md).
    :param name: the lock name; every process migrating the same database must use the same.
    :param timeout: seconds to wait for the lock; ``None`` waits until it is free.
    :param pooler: what sits between the connection and Postgres, as for
        :func:`pglock.pg_lock` (docs/pgbouncer.md); default ``"auto"``.
    :raises pglock.LockNotAcquired: not acquired within ``timeout``.
    :raises pglock.UnsupportedServer: a hot standby, or a pooler session locks cannot work
        through (docs/pgbouncer.md).
    :raises pglock.LockLost: at the exit, when the dedicated connection was lost meanwhile.
    :raises TypeError: an unsupported ``connection_or_url``; ``ValueError``: a bad name,
        timeout or ``pooler`` (both before connecting).
    """
    name = validate_name(name)
    t = validate_timeout(timeout)
    mode = validate_pooler(pooler)
    return _hold(_opener(connection_or_url), name, t, mode)


# An opener returns (connection for pglock, close(discard: bool)).
_Opener = Callable[[], tuple[Any, Callable[[bool], None]]]


def _opener(source: object) -> _Opener:
    """Decide, without I/O, how to open the dedicated connection."""
    kind = classify(
        source,
        {Kind.DSN, Kind.ENGINE, Kind.SA_CONNECTION, Kind.URL},
        api="migration_lock",
        hints={Kind.SESSION: "pass session.get_bind()"},
    )
    if kind is Kind.DSN:
        source = dsn(source, "the database URL")
        if "://" in source:
            from sqlalchemy.engine import make_url

            return _url_opener(make_url(source))
        return _psycopg_opener(source)  # a libpq key=value connection string
    if kind is Kind.URL:
        return _url_opener(cast(Any, source))
    engine: Any = cast(Any, source).engine if kind is Kind.SA_CONNECTION else source
    dialect = engine.dialect
    if dialect.name != "postgresql":
        raise TypeError(f"migration_lock needs PostgreSQL; this engine uses {dialect.name}")
    if dialect.driver == "psycopg":
        return _engine_opener(engine)
    return _url_opener(engine.url)


def _url_opener(url: Any) -> _Opener:
    if url.get_backend_name() != "postgresql":
        raise TypeError(f"migration_lock needs PostgreSQL; this URL is for {url.drivername}")
    # libpq reads postgresql:// URLs itself; SQLAlchemy's driver suffix is not part of them.
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    return _psycopg_opener(dsn)


def _psycopg_opener(dsn: str) -> _Opener:
    def open_() -> tuple[Any, Callable[[bool], None]]:
        conn = psycopg.connect(make_conninfo(dsn, **connect_extra(dsn)), autocommit=True)
        return conn, lambda discard: conn.close()

    return open_


def _engine_opener(engine: Any) -> _Opener:
    def open_() -> tuple[Any, Callable[[bool], None]]:
        sa_conn = engine.connect()

        def close(discard: bool) -> None:
            if discard and not sa_conn.invalidated:
                sa_conn.invalidate()
            sa_conn.close()

        return sa_conn, close

    return open_


@contextlib.contextmanager
def _hold(opener: _Opener, name: str, timeout: float | None, pooler: str) -> Iterator[None]:
    conn, close = opener()
    discard = True
    try:
        lock = PgLock(conn, name, pooler=pooler)
        _wait(lock, name, timeout)
        discard = False
        try:
            yield
        finally:
            try:
                lock.release()
            except BaseException:
                discard = True
                raise
            finally:
                logger.info("released migration lock %r", name)
    finally:
        close(discard)


def _wait(lock: PgLock, name: str, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    interval = _FIRST_POLL
    announced = False
    while not lock.acquire(blocking=False):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise LockNotAcquired.for_names([name], keys=[lock.keys[0]], timeout=timeout)
        if not announced:
            logger.info("waiting for migration lock %r: another process is migrating", name)
            announced = True
        pause = interval if deadline is None else min(interval, deadline - now)
        time.sleep(pause)
        interval = min(interval * 2, _MAX_POLL)
    logger.info("acquired migration lock %r", name)

