"""Revision pglock_0005 (the internal helpers run with their caller's rights): upgrade from 0004
and downgrade back with a lease held and waiters queued behind it, through Alembic and
``pglock install``. A role with the documented grants (GRANT ... ON ALL FUNCTIONS and ALTER
DEFAULT PRIVILEGES, given at 0004) can call ``hand_over_v4`` directly at 0004 (rolled back
here), and not at 0005; the waiters queued across each step are served in order."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import drop_roles, with_params
from psycopg import errors as pg_errors
from test_lease_schema import alembic, db  # noqa: F401  (the fixture)

import pglock
from pglock import _lease

pytestmark = pytest.mark.timeout(180)

HELPERS = ("hand_over_v4", "take_over_v4")


@pytest.fixture
def app_role(db: str) -> Iterator[str]:  # noqa: F811
    """A role with the documented grants, given at revision 0004 (roles are cluster-wide)."""
    role = f"pglock_app_{uuid.uuid4().hex[:8]}"
    alembic("-x", f"dsn={db}", "upgrade", "pglock_0004")
    with psycopg.connect(db, autocommit=True) as c:
        c.execute(f"CREATE ROLE {role} LOGIN")
        c.execute(f"GRANT USAGE ON SCHEMA pglock TO {role}")
        c.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA pglock TO {role}")
        c.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA pglock GRANT EXECUTE ON FUNCTIONS TO {role}")
    try:
        yield role
    finally:
        _lease.shutdown()
        drop_roles(db, [role], owned_in=[db])


def definer(dsn: str) -> dict[str, bool]:
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT proname, prosecdef FROM pg_proc WHERE pronamespace = 'pglock'::regnamespace"
            " AND proname = ANY(%s)", (list(HELPERS),)
        ).fetchall()
    return dict(rows)


def revisions(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return [r[0] for r in c.execute("SELECT revision FROM pglock.schema_revision ORDER BY 1")]


def hand_over_directly(dsn: str, name: str) -> list[tuple[Any, ...]]:
    """``hand_over_v4`` called by the role itself, rolled back."""
    with psycopg.connect(dsn) as c:
        try:
            return c.execute("SELECT holder, token FROM pglock.hand_over_v4(%s, 1)",
                             (name,)).fetchall()
        finally:
            c.rollback()


class Line:
    """A lease held by this test and waiters queued behind it, each recording its token."""

    def __init__(self, dsn: str, admin: psycopg.Connection[Any], n: int) -> None:
        self.dsn, self.admin = dsn, admin
        self.name = f"mig:{uuid.uuid4()}"
        self.holder = pglock.lease(dsn, self.name, ttl=30)
        assert self.holder.acquire(timeout=0)
        self.got: list[tuple[str, int | None]] = []
        self.threads: list[threading.Thread] = []
        self.waiters = [pglock.lease(dsn, self.name, ttl=30) for _ in range(n)]
        for i, w in enumerate(self.waiters):
            self.threads.append(threading.Thread(target=self._wait, args=(w,)))
            self.threads[-1].start()
            deadline = time.monotonic() + 30
            while len(self.queued()) < i + 1:
                assert time.monotonic() < deadline, f"waiter {i} never queued"
                time.sleep(0.01)

    def _wait(self, lease: pglock.Lease) -> None:
        if lease.acquire(timeout=90):
            self.got.append((lease.holder, lease.token))
            lease.release()

    def queued(self) -> list[str]:
        rows = self.admin.execute(
            "SELECT holder FROM pglock.lease_waiter WHERE name = %s ORDER BY id", (self.name,)
        ).fetchall()
        return [r[0] for r in rows]

    def serve(self) -> None:
        """Release; every waiter is granted in arrival order, with larger tokens."""
        assert self.queued() == [w.holder for w in self.waiters]
        self.holder.release()
        for t in self.threads:
            t.join(60)
        assert [h for h, _ in self.got] == [w.holder for w in self.waiters]
        tokens = [t for t in (self.holder.token, *(t for _, t in self.got)) if t is not None]
        assert len(tokens) == len(self.got) + 1, tokens
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens


def test_0005_upgrades_from_0004_and_downgrades_back_with_waiters_queued(
    db: str, app_role: str, app_name: str  # noqa: F811
) -> None:
    app = with_params(db, user=app_role, application_name=app_name)
    with psycopg.connect(db, autocommit=True) as admin:
        # At 0004 the documented grants let the role hand a live lease to the queue's head.
        line = Line(app, admin, 2)
        assert definer(db) == dict.fromkeys(HELPERS, True)
        handed = hand_over_directly(app, line.name)
        assert [h for h, _ in handed] == [line.waiters[0].holder], handed
        alembic("-x", f"dsn={db}", "upgrade", "pglock_0005")  # with the waiters queued
        assert definer(db) == dict.fromkeys(HELPERS, False)
        assert "pglock_0005" in revisions(db)
        with pytest.raises(pg_errors.InsufficientPrivilege):
            hand_over_directly(app, line.name)
        line.serve()

        line = Line(app, admin, 2)
        alembic("-x", f"dsn={db}", "downgrade", "pglock_0004")
        assert definer(db) == dict.fromkeys(HELPERS, True)
        assert "pglock_0005" not in revisions(db)
        line.serve()

        line = Line(app, admin, 1)
        assert pglock.install(db) == ["pglock_0005"]  # pglock install, from 0004
        assert definer(db) == dict.fromkeys(HELPERS, False)
        with pytest.raises(pg_errors.InsufficientPrivilege):
            hand_over_directly(app, line.name)
        line.serve()
        alembic("-x", f"dsn={db}", "upgrade", "pglock@head")  # Alembic catches up, idempotent
        assert definer(db) == dict.fromkeys(HELPERS, False)
        assert revisions(db)[-1] == "pglock_0005"
