"""Fixtures shared by the integration tests that need the pglock schema.

A module that wants another database (other schemas, none installed) defines its own ``db``
(pytest prefers a module's fixture to this one).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from _pgdb import sa_url
from test_lease_support import lease_database, with_app

from pglock import _lease


@pytest.fixture(scope="module")
def db(pg_dsn: str) -> Iterator[str]:
    """A database of the module's own with the pglock schema installed; dropped after it."""
    with lease_database(pg_dsn) as dsn:
        yield dsn


@pytest.fixture
def dsn(db: str, app_name: str) -> Iterator[str]:
    """``db`` with this test's application_name; pglock's DSN connections and listeners for it
    are closed after the test."""
    yield with_app(db, app_name)
    _lease.shutdown()


@pytest.fixture
def engine(pg_dsn: str, app_name: str) -> Iterator[sa.Engine]:
    """A SQLAlchemy engine (psycopg driver, no pool) whose sessions carry the test's
    application_name."""
    eng = sa.create_engine(
        sa_url(pg_dsn), connect_args={"application_name": app_name}, poolclass=sa.NullPool
    )
    try:
        yield eng
    finally:
        eng.dispose()
