"""Revision pglock_0004 (the lease waiter queue): upgrade from 0003 and downgrade back, with
leases working on both sides (the client uses the 0001 functions where 0004 is missing)."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from test_lease_schema import alembic, db  # noqa: F401  (the fixture)

import pglock
from pglock import _lease

pytestmark = pytest.mark.timeout(180)


def _queue_objects(dsn: str) -> tuple[bool, int]:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT to_regclass('pglock.lease_waiter') IS NOT NULL,"
            " (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            "  WHERE n.nspname = 'pglock' AND p.proname LIKE '%\\_v4')"
        ).fetchone()
    assert row is not None
    return bool(row[0]), int(row[1])


def _cycle(dsn: str) -> None:
    name = f"q:{uuid.uuid4()}"
    with pglock.lease(dsn, name, ttl=5, timeout=1) as lease:
        assert lease.token is not None
        assert not pglock.lease(dsn, name, ttl=5).acquire(timeout=0.2)


def test_0004_upgrades_from_0003_and_downgrades_back(db: str) -> None:  # noqa: F811
    alembic("-x", f"dsn={db}", "upgrade", "pglock_0003")
    assert _queue_objects(db) == (False, 0)
    _cycle(db)
    _lease.shutdown()
    alembic("-x", f"dsn={db}", "upgrade", "pglock_0004")
    assert _queue_objects(db) == (True, 7)  # 6 lease-queue functions and token_epoch_v4
    _cycle(db)
    alembic("-x", f"dsn={db}", "downgrade", "pglock_0003")
    assert _queue_objects(db) == (False, 0)
    _cycle(db)  # the functions are gone: this process notices and uses 0001's
    _lease.shutdown()
