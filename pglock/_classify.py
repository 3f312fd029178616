"""What a caller may pass: the one place that tells a connection, a pool, an engine and a DSN
apart (subclasses included), with no I/O and no import of an optional package not yet loaded.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping
from typing import Any, cast

import psycopg

from ._keys import exact


class Kind(enum.Enum):
    """What a caller passed; the value is how an error names it."""

    CONNECTION = "a psycopg.Connection"
    SA_CONNECTION = "a SQLAlchemy Connection"
    SESSION = "a SQLAlchemy ORM Session"
    POOL = "a psycopg_pool.ConnectionPool"
    ENGINE = "a SQLAlchemy Engine"
    DSN = "a connection string (DSN)"
    URL = "a SQLAlchemy URL"
    SA_POOL = "a SQLAlchemy Pool"
    DJANGO = "a Django connection (django.db.connection)"


#: A connection the caller holds: locks taken on it live in its session.
HELD = frozenset({Kind.CONNECTION, Kind.SA_CONNECTION, Kind.SESSION, Kind.DJANGO})
#: Somewhere pglock takes connections from (or opens them, for a DSN).
SOURCES = frozenset({Kind.POOL, Kind.ENGINE, Kind.DSN})
#: The SQLAlchemy kinds: they need its psycopg (3) driver wherever pglock uses the connection.
SQLALCHEMY = frozenset({Kind.SA_CONNECTION, Kind.SESSION, Kind.ENGINE})


class Deferred:
    """A pool or engine made at the first use (a DSN ``Locker``'s own pool): lock constructors
    call :attr:`resolve` only when a lock first needs a connection."""

    __slots__ = ("resolve",)

    def __init__(self, resolve: Callable[[], object]) -> None:
        self.resolve = resolve


def describe(obj: object) -> str:
    """``module.QualName`` of ``obj``'s type, for error messages."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _from_module(obj: object, prefix: str) -> bool:
    """Is ``obj`` an instance of a class defined under ``prefix`` (or of a subclass of one)?"""
    return any(c.__module__.startswith(prefix) for c in type(obj).__mro__)


def _synchronous_only(what: str) -> TypeError:
    return TypeError(f"pglock is synchronous: pass a synchronous {what}, not an asyncio one")


def kind_of(obj: object) -> Kind | None:
    """What ``obj`` is, or None for anything pglock never takes.

    :raises TypeError: an asyncio connection, pool or engine (pglock is synchronous)."""
    if isinstance(obj, str):
        return Kind.DSN
    if isinstance(obj, psycopg.Connection):
        return Kind.CONNECTION
    if isinstance(obj, psycopg.AsyncConnection):
        raise _synchronous_only("psycopg.Connection")
    if _from_module(obj, "psycopg_pool."):
        from psycopg_pool import ConnectionPool

        if isinstance(obj, ConnectionPool):
            return Kind.POOL
        raise _synchronous_only("psycopg_pool.ConnectionPool")
    if _from_module(obj, "sqlalchemy."):
        return _sqlalchemy_kind(obj)
    if _from_module(obj, "django."):
        from ._django import wrapper_of  # Django is loaded: obj's class comes from it

        return Kind.DJANGO if wrapper_of(obj) is not None else None
    return None


def _sqlalchemy_kind(obj: object) -> Kind | None:
    # Not "import sqlalchemy.ext.asyncio": it raises ImportError without greenlet (optional
    # since SQLAlchemy 2.1), and an async object exists only once that module is loaded.
    if _from_module(obj, "sqlalchemy.ext.asyncio."):
        raise _synchronous_only("SQLAlchemy Engine, Connection or Session")
    from sqlalchemy.engine import URL, Connection, Engine
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import Pool

    for cls, kind in (
        (Engine, Kind.ENGINE),
        (Connection, Kind.SA_CONNECTION),
        (Session, Kind.SESSION),
        (URL, Kind.URL),
        (Pool, Kind.SA_POOL),
    ):
        if isinstance(obj, cls):
            return kind
    return None


def classify(
    obj: object, accepted: Collection[Kind], *, api: str, hints: Mapping[Kind, str] | None = None
) -> Kind:
    """What ``obj`` is, when ``api`` accepts it (one of ``accepted``).

    :param hints: for kinds it does not take, what to use instead (appended to the error).
    :raises TypeError: ``obj`` is not accepted (or is asynchronous): what ``api`` takes and got.
    """
    kind = kind_of(obj)
    if kind is not None and kind in accepted:
        return kind
    takes = [k.value for k in Kind if k in accepted]
    wanted = ", ".join(takes[:-1]) + f" or {takes[-1]}" if len(takes) > 1 else takes[0]
    if any(k in SQLALCHEMY for k in accepted):
        wanted += " (SQLAlchemy on the psycopg driver: postgresql+psycopg://)"
    got = kind.value if kind is not None else describe(obj)
    message = f"{api} takes {wanted}; got {got}"
    hint = (hints or {}).get(kind) if kind is not None else None
    raise TypeError(f"{message}: {hint}" if hint else message)


def dsn(source: object, what: str = "the DSN") -> str:
    """A :attr:`Kind.DSN` source by value (:func:`pglock._keys.exact`); ValueError if blank."""
    text = exact(cast(str, source))
    if not text.strip():
        raise ValueError(f"{what} must not be empty")
    return text


def check_driver(dialect: Any) -> None:
    """Refuse (TypeError) a SQLAlchemy dialect other than PostgreSQL on psycopg (3)."""
    if dialect.name != "postgresql" or dialect.driver != "psycopg":
        raise TypeError(
            "pglock needs SQLAlchemy's psycopg (3) driver on PostgreSQL (URLs like "
            f"postgresql+psycopg://...); this engine uses {dialect.name}+{dialect.driver}"
        )
