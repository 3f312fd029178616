"""Django database connections (docs/django.md): ``django.db.connection`` (a ``ConnectionProxy``)
or ``connections[alias]`` (a ``DatabaseWrapper``) on Django's PostgreSQL backend with psycopg 3,
resolved to the psycopg connection underneath.

pglock reaches this module only for an object whose class comes from ``django.``: Django is
then loaded already, and ``import pglock`` never imports it.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from .errors import InvalidConnectionState

logger = logging.getLogger("pglock.django")


def wrapper_of(obj: object) -> Any:
    """The ``DatabaseWrapper`` behind ``obj`` (a proxy gives the calling thread's), or None
    when ``obj`` is no Django database connection. Sends nothing."""
    from django.db.backends.base.base import BaseDatabaseWrapper  # type: ignore[import-untyped]
    from django.utils.connection import ConnectionProxy  # type: ignore[import-untyped]

    if isinstance(obj, ConnectionProxy):
        # The proxy forwards every attribute to connections[alias] of the calling thread.
        obj = obj.__dict__["_connections"][obj.__dict__["_alias"]]
    return obj if isinstance(obj, BaseDatabaseWrapper) else None


def check_backend(wrapper: Any) -> None:
    """Refuse (TypeError), before any connection is made, a wrapper that is not Django's
    PostgreSQL backend on psycopg (3)."""
    alias = getattr(wrapper, "alias", "?")
    if wrapper.vendor != "postgresql":
        raise TypeError(
            f"pglock needs Django's PostgreSQL backend; the Django connection {alias!r} is "
            f"{wrapper.vendor!r} (ENGINE {wrapper.settings_dict.get('ENGINE')!r})"
        )
    database = getattr(wrapper, "Database", None)
    if database is not psycopg:
        name = getattr(database, "__name__", type(database).__name__)
        raise TypeError(
            f"pglock needs Django's PostgreSQL backend on psycopg (3); the Django connection "
            f"{alias!r} uses {name}: install psycopg (Django prefers it to psycopg2 when both "
            "are installed)"
        )


def connection_of(obj: object) -> tuple[psycopg.Connection[Any], Any]:
    """The psycopg connection of a Django connection and its wrapper, connected as Django's
    own ``cursor()`` would (health check, then connect).

    :raises TypeError: not Django's PostgreSQL backend on psycopg 3 (before connecting).
    :raises pglock.InvalidConnectionState: the ``atomic`` block it is in must be rolled back.
    :raises django.db.DatabaseError: a wrapper used from another thread than its own, or
        connecting failed (Django's own errors, as any query of the caller would raise).
    """
    wrapper = wrapper_of(obj)
    if wrapper is None:
        raise TypeError(f"not a Django database connection: {type(obj)!r}")
    check_backend(wrapper)
    wrapper.validate_thread_sharing()
    if wrapper.needs_rollback:
        raise InvalidConnectionState(
            "the Django connection is in an 'atomic' block that must be rolled back (an error "
            "occurred in it): leave the block before taking a lock"
        ) from wrapper.rollback_exc
    wrapper.close_if_health_check_failed()
    wrapper.ensure_connection()
    conn = wrapper.connection
    if not isinstance(conn, psycopg.Connection):
        raise TypeError(f"expected a psycopg connection under Django, got {type(conn)!r}")
    return conn, wrapper


def connected(obj: object) -> psycopg.Connection[Any] | None:
    """The psycopg connection of a Django connection if it is connected, else None (no I/O).

    :raises TypeError: not Django's PostgreSQL backend on psycopg 3.
    """
    wrapper = wrapper_of(obj)
    if wrapper is None:
        raise TypeError(f"not a Django database connection: {type(obj)!r}")
    check_backend(wrapper)
    conn = wrapper.connection
    return conn if isinstance(conn, psycopg.Connection) else None


def no_transaction(api: str) -> InvalidConnectionState:
    """``api`` (a transaction lock) on a Django connection in autocommit, outside ``atomic``."""
    return InvalidConnectionState(
        f"{api} needs an open transaction: this Django connection is in autocommit mode "
        "(outside transaction.atomic()), so the lock would be released as soon as it is "
        "taken; use 'with transaction.atomic():' (or pg_lock for a session-level lock)"
    )


def pool_of(obj: object, *, open: bool = True) -> Any:
    """The ``psycopg_pool.ConnectionPool`` of a Django connection configured with
    ``OPTIONS["pool"]`` (Django 5.1+), opened if Django has not opened it yet (unless not
    ``open``: then no I/O).

    :raises TypeError: no pool configured, or not PostgreSQL on psycopg 3.
    """
    wrapper = wrapper_of(obj)
    if wrapper is None:
        raise TypeError(f"not a Django database connection: {type(obj)!r}")
    check_backend(wrapper)
    pool = getattr(wrapper, "pool", None)
    if pool is None:
        raise TypeError(
            f"the Django connection {wrapper.alias!r} has no pool (DATABASES OPTIONS 'pool', "
            "Django 5.1+): pass a psycopg_pool.ConnectionPool, or use "
            "pglock.pg_lock(connection, ...) on the connection itself"
        )
    if open:
        pool.open()  # as Django's own first connection does; a no-op once open
    return pool
