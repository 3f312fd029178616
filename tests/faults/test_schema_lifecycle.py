"""T28 schema lifecycle: upgrades and downgrades while leases and permits are live.

* An ``alembic upgrade head`` over a schema that ``pglock install`` made, run while a lease and
  a semaphore permit are held, changes neither (holder, token, expiry, permits).
* A downgrade refuses (SQLSTATE 55006, the whole run rolled back) while any lease or permit is
  live, naming what is live: dropping them would let the next process in while the holder
  still believes it holds the lock. Expired rows do not block it; once nothing is live it runs.

Concurrent installs and upgrades (also T28) are in tests/migrations (see docs/guarantees.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _pgdb import throwaway_database, with_params

import pglock
from pglock import _lease, _schema

from .oracles import wait_for

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def db(pg_dsn: str, app_name: str) -> Iterator[str]:
    with throwaway_database(pg_dsn, prefix="pglock_life") as dsn:
        try:
            yield with_params(dsn, application_name=app_name)
        finally:
            _lease.shutdown()


def alembic(db: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PGLOCK_DSN", None)
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-x", f"dsn={db}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )


def state(c: psycopg.Connection[Any]) -> dict[str, Any]:
    """Every lease and permit row, and the schema objects and revisions, as they are now."""
    def rows(query: str) -> list[tuple[Any, ...]]:
        return c.execute(query).fetchall()

    present = rows("SELECT to_regclass('pglock.lease') IS NOT NULL")[0][0]
    return {
        "schema": rows("SELECT count(*) FROM pg_namespace WHERE nspname = 'pglock'")[0][0],
        "functions": rows(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'pglock'"
        )[0][0],
        "leases": rows("SELECT name, holder, token, acquired_at, expires_at FROM pglock.lease"
                       " ORDER BY name") if present else None,
        "permits": rows("SELECT semaphore, holder, permits, expires_at"
                        " FROM pglock.semaphore_permit ORDER BY 1, 2") if present else None,
        "alembic": rows("SELECT version_num FROM alembic_version")
        if rows("SELECT to_regclass('alembic_version') IS NOT NULL")[0][0] else None,
    }


def test_T28_upgrade_keeps_live_leases_and_downgrade_refuses_to_drop_them(
    db: str, name: str
) -> None:
    _schema.install(db)  # as `pglock install` does
    lease = pglock.lease(db, name, ttl=60, keepalive=False)
    sem = pglock.semaphore(db, f"{name}:sem", limit=1, ttl=60)
    with psycopg.connect(db, autocommit=True) as c:
        try:
            assert lease.acquire(timeout=0) and sem.acquire(timeout=0)
            held = state(c)
            assert len(held["leases"]) == 1 and len(held["permits"]) == 1

            # Alembic adopts the installed schema: every statement runs again, nothing changes.
            up = alembic(db, "upgrade", "head")
            assert up.returncode == 0, up.stderr
            after = state(c)
            assert after["alembic"] == [(_schema.head(),)]
            assert {k: v for k, v in after.items() if k != "alembic"} == {
                k: v for k, v in held.items() if k != "alembic"
            }
            lease.check()

            # A downgrade with a live permit and a live lease: refused, all rolled back.
            down = alembic(db, "downgrade", "base")
            assert down.returncode != 0
            assert "pglock downgrade refused: 1 live semaphore permit(s)" in down.stderr, (
                down.stderr
            )
            assert state(c) == after
            sem.release()

            # Now the lease alone blocks it (the first revision's own check, run directly).
            first = _schema.revisions()[0].module
            with (
                pytest.raises(psycopg.errors.ObjectInUse, match=r"1 live lease\(s\)"),
                c.transaction(),
            ):
                for stmt in first.downgrade_statements("pglock"):
                    c.execute(stmt)
            lease.check()
            lease.release()

            # An expired lease does not block a downgrade.
            short = pglock.lease(db, f"{name}:short", ttl=0.3, keepalive=False)
            assert short.acquire(timeout=0)
            wait_for(
                lambda: c.execute(
                    "SELECT expires_at < clock_timestamp() FROM pglock.lease WHERE name = %s",
                    (f"{name}:short",),
                ).fetchone() == (True,),
                what="the short lease to expire on the database clock",
            )
            down = alembic(db, "downgrade", "base")
            assert down.returncode == 0, down.stderr
            gone = state(c)
            assert (gone["schema"], gone["functions"], gone["leases"], gone["alembic"]) == (
                0, 0, None, [],
            )
        finally:
            sem.close()
