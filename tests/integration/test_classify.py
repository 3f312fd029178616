"""One classifier of what a caller passes (issue 11): every API that takes a connection, a
pool, an engine or a DSN decides what it got in ``pglock._classify``, so they agree. A user's
own subclass of ``Session``, ``Connection``, ``ConnectionPool`` or ``Engine`` is what its base
is, everywhere; refusals say what the API takes and what it got.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg_pool
import pytest
import sqlalchemy as sa
from _pgdb import sa_url
from sqlalchemy.orm import Session

import pglock
from pglock._classify import Kind, classify, kind_of


class MyConnection(psycopg.Connection[Any]):
    """An application's own connection class."""


class MyPool(psycopg_pool.ConnectionPool[Any]):
    """An application's own pool class."""


class MySession(Session):
    """An application's own Session class (the case that rwlock and lease_info refused)."""


@pytest.fixture
def engine(dsn: str) -> Iterator[sa.Engine]:
    e = sa.create_engine(sa_url(dsn))
    try:
        yield e
    finally:
        e.dispose()


def test_kind_of_names_every_accepted_type_and_its_subclasses(
    dsn: str, engine: sa.Engine
) -> None:
    with psycopg.connect(dsn) as c, MyConnection.connect(dsn) as mine:
        assert kind_of(c) is kind_of(mine) is Kind.CONNECTION
    pool = MyPool(dsn, open=False)
    assert kind_of(pool) is Kind.POOL
    assert kind_of(psycopg_pool.ConnectionPool(dsn, open=False)) is Kind.POOL
    assert kind_of(dsn) is Kind.DSN
    assert kind_of(engine) is Kind.ENGINE
    assert kind_of(engine.url) is Kind.URL
    assert kind_of(engine.pool) is Kind.SA_POOL
    with engine.connect() as sc:
        assert kind_of(sc) is Kind.SA_CONNECTION
    with MySession(engine) as s, Session(engine) as base:
        assert kind_of(s) is kind_of(base) is Kind.SESSION
    for other in (42, None, object(), b"dsn"):
        assert kind_of(other) is None


def test_asyncio_variants_are_refused_as_such(dsn: str) -> None:
    pool = psycopg_pool.AsyncConnectionPool(dsn, open=False)
    with pytest.raises(TypeError, match="synchronous"):
        kind_of(pool)


def test_a_refusal_says_what_the_api_takes_and_what_it_got() -> None:
    with pytest.raises(TypeError) as ei:
        classify(42, {Kind.POOL, Kind.DSN}, api="some_api", hints={Kind.CONNECTION: "x"})
    assert str(ei.value) == (
        "some_api takes a psycopg_pool.ConnectionPool or a connection string (DSN); "
        "got builtins.int"
    )
    with pytest.raises(TypeError) as ei:
        classify("dsn", {Kind.POOL}, api="some_api", hints={Kind.DSN: "use a pool"})
    assert str(ei.value) == (
        "some_api takes a psycopg_pool.ConnectionPool; got a connection string (DSN): use a pool"
    )


def test_a_session_subclass_works_with_every_api_that_takes_a_session(
    dsn: str, engine: sa.Engine
) -> None:
    name = f"test:{uuid.uuid4()}"
    with pglock.lease(dsn, name, ttl=30) as held, MySession(engine) as s:
        with pglock.pg_lock(s, f"{name}:pg"):
            pass
        pglock.xact_lock(s, f"{name}:xact")  # in the transaction the Session began
        info = pglock.lease_info(s, name)
        assert info is not None and info.holder == held.holder
        assert [i.name for i in pglock.list_leases(s, prefix=name)] == [name]
        with pglock.rwlock(s, f"{name}:rw").read():
            pass
        assert pglock.advisory_locks(s, f"{name}:none") == []
        s.rollback()


def test_subclasses_of_connection_and_pool_work_too(dsn: str) -> None:
    name = f"test:{uuid.uuid4()}"
    with MyConnection.connect(dsn, autocommit=True) as c:
        with pglock.pg_lock(c, name), pglock.rwlock(c, f"{name}:rw").write():
            pass
        assert pglock.lease_info(c, name) is None
    with MyPool(dsn, min_size=1, max_size=2) as pool:
        with pglock.pool_lock(pool, name):
            pass
        with pglock.lease(pool, f"{name}:lease", ttl=30):
            pass
        with pglock.semaphore(pool, f"{name}:sem", limit=1):
            pass
        with pglock.Locker(pool).lock(name):
            pass
