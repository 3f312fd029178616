"""T28 least privilege, and foreign holders (issue 6, security).

* **Least privilege.** A role with exactly the grants docs/leases.md documents for applications
  (read from the docs' "Permissions" section, so the two cannot drift apart) runs every lease
  operation (acquire, keepalive, extend, ``guard()`` in its transaction, ``lease_info``,
  ``list_leases``, a wait woken by the release NOTIFY on its own LISTEN, resume, release, on
  pool and DSN sources) and every semaphore operation, and is refused everything else: reading
  or writing the tables, drawing or resetting a token, changing a stored limit, creating objects
  in the schema, altering or dropping pglock's objects. Negative control: every refused
  statement is valid and runs for the owner (rolled back). Each documented grant is needed:
  without ``EXECUTE`` (``PUBLIC`` has none) or without ``USAGE`` on the schema the first
  statement is refused.
* **Foreign holders.** Another holder id, or the right holder with a wrong token, extends,
  renews, releases and guards nothing, through the SQL functions (called directly, as the
  application role) and through the API; the lease row stays exactly as it was. Negative
  control: the same calls with the right holder and token do act on the row.

Everything runs in a throwaway database of its own; the roles are dropped afterwards.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _pgdb import drop_roles, throwaway_database, with_params
from psycopg import errors as pg_errors
from psycopg_pool import ConnectionPool

import pglock
from pglock import _lease

from .oracles import wait_for

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "leases.md"

pytestmark = pytest.mark.timeout(60)


def documented_grants() -> list[str]:
    """The statements of the first ```sql block of docs/leases.md's "Permissions" section."""
    text = DOCS.read_text(encoding="utf-8")
    assert "\n## Permissions\n" in text, "docs/leases.md has no Permissions section"
    section = text.split("\n## Permissions\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```sql\n(.*?)```", section, re.S)
    assert m is not None, "the Permissions section has no sql block"
    statements = [s.strip() for s in m.group(1).split(";") if s.strip()]
    assert statements and all(
        s.startswith("GRANT ") and re.search(r"\bapp_role\b", s) for s in statements
    ), statements
    return statements


@dataclass(frozen=True)
class Roles:
    app: str  # exactly the documented grants
    no_execute: str  # USAGE on the schema only
    no_usage: str  # EXECUTE on the functions only


@pytest.fixture(scope="module")
def db(pg_dsn: str) -> Iterator[str]:
    with throwaway_database(pg_dsn, prefix="pglock_priv", install=True) as dsn:
        try:
            yield dsn
        finally:
            _lease.shutdown()  # connections pglock keeps for DSN sources, and listeners


@pytest.fixture(scope="module")
def roles(db: str, pg_dsn: str) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:8]
    made = Roles(f"pglock_app_{tag}", f"pglock_noexec_{tag}", f"pglock_nousage_{tag}")
    grants = documented_grants()
    with psycopg.connect(db, autocommit=True) as admin:
        for role in (made.app, made.no_execute, made.no_usage):
            admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
        for stmt in grants:
            admin.execute(re.sub(r"\bapp_role\b", made.app, stmt))
        admin.execute(f"GRANT USAGE ON SCHEMA pglock TO {made.no_execute}")
        admin.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA pglock TO {made.no_usage}")
    try:
        yield made
    finally:
        _lease.shutdown()
        # The database goes with the module's `db` fixture; roles are cluster-wide.
        drop_roles(pg_dsn, (made.app, made.no_execute, made.no_usage), owned_in=[db])


@pytest.fixture
def admin(db: str) -> Iterator[psycopg.Connection[Any]]:
    """The owner (the installing superuser), to look at the tables."""
    with psycopg.connect(db, autocommit=True, application_name="pglock-priv-admin") as c:
        yield c


def role_dsn(db: str, role: str, app_name: str) -> str:
    return with_params(db, user=role, application_name=app_name)


@pytest.fixture
def app_dsn(db: str, roles: Roles, app_name: str) -> Iterator[str]:
    yield role_dsn(db, roles.app, app_name)
    _lease.shutdown()


@pytest.fixture
def pool(app_dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(app_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}) as p:
        yield p


def lease_row(admin: psycopg.Connection[Any], name: str) -> tuple[Any, ...] | None:
    return admin.execute(
        "SELECT holder, token, acquired_at, expires_at, metadata, waiters"
        " FROM pglock.lease WHERE name = %s",
        (name,),
    ).fetchone()


def permit_rows(admin: psycopg.Connection[Any], name: str) -> list[tuple[Any, ...]]:
    return admin.execute(
        "SELECT holder, permits, acquired_at, expires_at FROM pglock.semaphore_permit"
        " WHERE semaphore = %s ORDER BY holder",
        (name,),
    ).fetchall()


def listening(channel: str, dsn: str) -> psycopg.Connection[Any]:
    c = psycopg.connect(dsn, autocommit=True)
    c.execute(f"LISTEN {channel}")
    return c


def notified(c: psycopg.Connection[Any], payload: str) -> list[str]:
    got = [n.payload for n in c.notifies(timeout=5, stop_after=1)]
    assert payload in got, got
    return got


# --- least privilege ---------------------------------------------------------------------------


def test_T28_the_app_role_is_not_privileged(pool: ConnectionPool[Any], roles: Roles) -> None:
    with pool.connection() as c:
        row = c.execute(
            "SELECT current_user::text, r.rolsuper, r.rolbypassrls, "
            " (SELECT count(*) FROM pg_auth_members m WHERE m.member = r.oid)"
            " FROM pg_roles r WHERE r.rolname = current_user"
        ).fetchone()
    assert row == (roles.app, False, False, 0)


def test_T28_least_privilege_role_runs_every_lease_operation(
    pool: ConnectionPool[Any], app_dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    # acquire, and the keepalive renews it (extend_many as the role)
    a = pglock.lease(pool, name, ttl=0.9, metadata={"by": "app"})
    assert a.acquire(timeout=0)
    row = lease_row(admin, name)
    assert row is not None and row[:4] == (a.holder, a.token, a.acquired_at, a.expires_at)
    first_expiry = row[3]
    wait_for(
        lambda: (r := lease_row(admin, name)) is not None and r[3] > first_expiry,
        timeout=5,
        what="a keepalive renewal",
    )
    a.check()
    # extend
    a.extend(30)
    row = lease_row(admin, name)
    assert row is not None and row[1] == a.token
    left = admin.execute("SELECT %s - clock_timestamp()", (row[3],)).fetchone()
    assert left is not None and left[0].total_seconds() > 25
    # guard() in the role's own transaction locks the row until it ends
    with psycopg.connect(app_dsn) as c:
        with c.transaction():
            a.guard(c)
            with pytest.raises(pg_errors.LockNotAvailable):
                admin.execute(
                    "SELECT 1 FROM pglock.lease WHERE name = %s FOR UPDATE NOWAIT", (name,)
                )
        # Control: the row lock ended with the transaction.
        admin.execute("SELECT 1 FROM pglock.lease WHERE name = %s FOR UPDATE NOWAIT", (name,))
        # lease_info and list_leases, on a connection and on the source
        info = pglock.lease_info(c, name)
        assert info is not None
        assert (info.holder, info.token, info.metadata) == (a.holder, a.token, {"by": "app"})
        via_pool = pglock.lease_info(pool, name)
        assert via_pool is not None and via_pool.token == a.token
        assert [i.name for i in pglock.list_leases(c, prefix=name)] == [name]
        assert [i.name for i in pglock.list_leases(pool, prefix=name)] == [name]
        c.rollback()

    # A queued waiter is handed the lease by the release (its answer, in this process), whose
    # NOTIFY, sent from inside the function as the role, names the grant.
    watch = listening("pglock_lease", app_dsn)  # the role itself hears the NOTIFY
    try:
        b = pglock.lease(pool, name, ttl=5)
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(b.acquire(timeout=20)))
        t.start()
        wait_for(
            lambda: (r := lease_row(admin, name)) is not None and r[5] is True,
            what="the waiter to mark the lease",
        )
        a.release()
        t.join(25)
        assert not t.is_alive() and got == [True]
        got_payloads = [n.payload for n in watch.notifies(timeout=5, stop_after=1)]
        grant = ["grant", name, b.holder, b.token]
        assert [json.loads(p)[:4] for p in got_payloads] == [grant], got_payloads
    finally:
        watch.close()
    assert a.token is not None and b.token is not None and b.token > a.token
    row = lease_row(admin, name)
    assert row is not None and row[:2] == (b.holder, b.token)
    b.release()
    assert lease_row(admin, name) is None

    # resume by holder id
    first = pglock.lease(pool, f"{name}:resume", ttl=10, keepalive=False)
    first.acquire()
    again = pglock.lease(pool, f"{name}:resume", holder=first.holder, resume=True, ttl=10)
    assert again.acquire() and again.token == first.token
    again.release()
    with pytest.raises(pglock.LockLost):
        first.release()

    # a DSN source
    with pglock.lease(app_dsn, f"{name}:dsn", ttl=5, timeout=0) as d:
        info = pglock.lease_info(app_dsn, f"{name}:dsn")
        assert info is not None and info.token == d.token
    assert lease_row(admin, f"{name}:dsn") is None


def test_T28_least_privilege_role_runs_every_semaphore_operation(
    pool: ConnectionPool[Any], app_dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    sem = pglock.semaphore(pool, name, limit=2, ttl=0.9)
    other = pglock.semaphore(pool, name, limit=2, ttl=5)
    done = threading.Event()
    watch = listening("pglock_semaphore", app_dsn)
    try:
        with sem.hold(permits=2, timeout=0) as permit:
            rows = permit_rows(admin, name)
            assert [r[1] for r in rows] == [2]
            first_expiry = rows[0][3]
            wait_for(
                lambda: (r := permit_rows(admin, name)) and r[0][3] > first_expiry,
                timeout=5,
                what="a keepalive renewal of the permits",
            )
            permit.check()
            assert sem.count() == 2 and other.count() == 2
            assert other.acquire(timeout=0) is False
            with pytest.raises(pglock.LimitMismatch):
                pglock.semaphore(pool, name, limit=3).acquire(timeout=0)
            got: list[bool] = []

            def waiter() -> None:  # semaphore.acquire() permits belong to their thread
                got.append(other.acquire(timeout=20))
                done.wait(20)
                if got[0]:
                    other.release()

            t = threading.Thread(target=waiter)
            t.start()
            wait_for(
                lambda: admin.execute(
                    "SELECT waiters FROM pglock.semaphore WHERE name = %s", (name,)
                ).fetchone()
                == (True,),
                what="the waiter to mark the semaphore",
            )
        wait_for(lambda: got, timeout=25, what="the waiter to be granted")
        assert got == [True]
        notified(watch, name)
        assert [r[1] for r in permit_rows(admin, name)] == [1]
        assert other.count() == 1
        done.set()
        t.join(25)
        assert not t.is_alive()
        assert permit_rows(admin, name) == [] and sem.count() == 0
        # a DSN source
        with pglock.semaphore(app_dsn, f"{name}:dsn", limit=1).hold(timeout=0):
            assert [r[1] for r in permit_rows(admin, f"{name}:dsn")] == [1]
        assert permit_rows(admin, f"{name}:dsn") == []
    finally:
        done.set()
        watch.close()
        sem.close()
        other.close()


FORBIDDEN = [
    "SELECT * FROM pglock.lease",
    "UPDATE pglock.lease SET expires_at = expires_at + interval '1 day'",
    "UPDATE pglock.lease SET token = 1",
    "DELETE FROM pglock.lease",
    "INSERT INTO pglock.lease (name, holder, token, acquired_at, expires_at)"
    " VALUES ('forged', 'me', 1, now(), now() + interval '1 day')",
    "TRUNCATE pglock.lease",
    "SELECT nextval('pglock.lease_token')",
    "SELECT setval('pglock.lease_token', 1)",
    "ALTER SEQUENCE pglock.lease_token RESTART",
    "SELECT * FROM pglock.semaphore",
    "UPDATE pglock.semaphore SET max_permits = 1000",
    "DELETE FROM pglock.semaphore_permit",
    "INSERT INTO pglock.schema_revision (revision) VALUES ('forged')",
    "CREATE TABLE pglock.planted (x int)",
    "CREATE FUNCTION pglock.clock_timestamp() RETURNS timestamptz LANGUAGE sql"
    " AS 'SELECT pg_catalog.now()'",
    "ALTER FUNCTION pglock.guard(text, text, bigint) SECURITY INVOKER",
    "ALTER FUNCTION pglock.acquire(text, text, double precision, jsonb, double precision,"
    " boolean) RESET search_path",
    "DROP FUNCTION pglock.release(text, text, bigint)",
    "DROP TABLE pglock.lease",
]


def test_T28_least_privilege_role_cannot_touch_pglock_objects(
    pool: ConnectionPool[Any], app_dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    held = pglock.lease(pool, name, ttl=30, keepalive=False)
    held.acquire()
    before = lease_row(admin, name)
    token_before = admin.execute("SELECT last_value FROM pglock.lease_token").fetchone()
    with psycopg.connect(app_dsn, autocommit=True) as c:
        for stmt in FORBIDDEN:
            with pytest.raises(pg_errors.InsufficientPrivilege):
                c.execute(stmt)
    assert lease_row(admin, name) == before
    assert admin.execute("SELECT last_value FROM pglock.lease_token").fetchone() == token_before
    # Negative control: each statement is valid, and runs for the owner (rolled back).
    for stmt in FORBIDDEN:
        with admin.transaction(force_rollback=True):
            admin.execute(stmt)
    assert lease_row(admin, name) == before
    held.release()


def test_T28_functions_are_security_definer_with_a_pinned_search_path(
    admin: psycopg.Connection[Any],
) -> None:
    rows = admin.execute(
        "SELECT p.proname, p.prosecdef, p.proconfig,"
        " has_function_privilege('public', p.oid, 'EXECUTE'),"
        " coalesce(obj_description(p.oid, 'pg_proc'), '') LIKE 'pglock internal%'"
        " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = 'pglock' ORDER BY 1"
    ).fetchall()
    # 7 lease functions, 4 semaphore, 6 of the lease queue and the token_epoch trigger (0004)
    assert len(rows) == 18, rows
    # The internal helpers run with their caller's rights (0005): the documented grants give
    # EXECUTE on every function, and the app role has no privilege on the tables.
    assert sorted(r[0] for r in rows if r[4]) == ["hand_over_v4", "take_over_v4"]
    for proname, secdef, config, public_exec, internal in rows:
        assert secdef is not internal, proname
        # 0005: an error a function catches itself stays an error under exit_on_error = on
        assert config == ["search_path=pg_catalog, pglock, pg_temp", "exit_on_error=off"], (
            proname, config,
        )
        assert not public_exec, proname


def test_T28_each_documented_grant_is_needed(
    db: str, roles: Roles, app_name: str, admin: psycopg.Connection[Any], name: str
) -> None:
    for role in (roles.no_execute, roles.no_usage):
        dsn = role_dsn(db, role, app_name)
        with pytest.raises(pg_errors.InsufficientPrivilege):
            pglock.lease(dsn, name, ttl=5, timeout=0).acquire()
        with pytest.raises(pg_errors.InsufficientPrivilege):
            pglock.lease_info(dsn, name)
        with pytest.raises(pg_errors.InsufficientPrivilege):
            pglock.semaphore(dsn, name, limit=1).acquire(timeout=0)
    assert lease_row(admin, name) is None
    assert permit_rows(admin, name) == []
    _lease.shutdown()


# --- foreign holders ---------------------------------------------------------------------------


def test_T28_a_foreign_holder_cannot_extend_release_or_guard_a_lease(
    pool: ConnectionPool[Any], app_dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    a = pglock.lease(pool, name, ttl=30, keepalive=False)
    a.acquire()
    assert a.token is not None
    h, tok = a.holder, a.token
    before = lease_row(admin, name)
    assert before is not None and before[:2] == (h, tok)
    wrong = [("intruder", tok), ("intruder", None), (h, tok + 1), (h, tok - 1), (h, 0)]

    with psycopg.connect(app_dsn, autocommit=True) as c:  # the application role
        for holder, token in wrong:
            assert c.execute(
                "SELECT * FROM pglock.extend(%s, %s, %s, 600)", (name, holder, token)
            ).fetchall() == [], (holder, token)
            if token is None:
                continue
            assert c.execute(
                "SELECT * FROM pglock.extend_many(%s, %s, %s, %s)",
                ([name], [holder], [token], [600.0]),
            ).fetchall() == [], (holder, token)
            assert c.execute(
                "SELECT status, notified FROM pglock.release(%s, %s, %s)", (name, holder, token)
            ).fetchall() == [("not_held", False)], (holder, token)
            with c.transaction():
                assert c.execute(
                    "SELECT pglock.guard(%s, %s, %s)", (name, holder, token)
                ).fetchone() == (False,), (holder, token)
        # Another holder asking for it is refused and told who holds it.
        refused = c.execute(
            "SELECT granted, holder, token FROM pglock.acquire(%s, 'intruder', 600, NULL, 0)",
            (name,),
        ).fetchone()
        assert refused == (False, h, tok)
        assert lease_row(admin, name) == before  # not a byte changed, expiry included

        # Through the API: another holder, with and without resume.
        b = pglock.lease(pool, name, ttl=600, holder="intruder", timeout=0)
        assert b.acquire() is False
        with pytest.raises(RuntimeError):
            b.extend()
        with pytest.raises(RuntimeError):
            b.release()
        with pytest.raises(pglock.LockLost):
            pglock.lease(pool, name, ttl=600, holder="intruder", resume=True).acquire()
        assert pglock.lease(pool, name, ttl=600, timeout=0).acquire() is False
        assert lease_row(admin, name) == before

        # Negative control: with the right holder and token the same calls do act.
        with c.transaction():
            assert c.execute("SELECT pglock.guard(%s, %s, %s)", (name, h, tok)).fetchone() == (
                True,
            )
        renewed = c.execute(
            "SELECT token, expires_at FROM pglock.extend(%s, %s, %s, 600)", (name, h, tok)
        ).fetchall()
        assert len(renewed) == 1 and renewed[0][0] == tok and renewed[0][1] > before[3]
        assert c.execute(
            "SELECT status FROM pglock.release(%s, %s, %s)", (name, h, tok)
        ).fetchall() == [("released",)]
    assert lease_row(admin, name) is None
    with pytest.raises(pglock.LockLost):
        a.release()


def test_T28_a_foreign_holder_cannot_extend_or_release_semaphore_permits(
    pool: ConnectionPool[Any], app_dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    sem = pglock.semaphore(pool, name, limit=1, ttl=30)
    try:
        assert sem.acquire(timeout=0)
        before = permit_rows(admin, name)
        assert len(before) == 1
        real = before[0][0]
        with psycopg.connect(app_dsn, autocommit=True) as c:
            for holder in ("intruder", real + "x", real[:-1], ""):
                assert c.execute(
                    "SELECT * FROM pglock.semaphore_extend(%s, %s, 600)", (name, [holder])
                ).fetchall() == [], holder
                assert c.execute(
                    "SELECT status FROM pglock.semaphore_release(%s, %s)", (name, holder)
                ).fetchall() == [("not_held",)], holder
            granted = c.execute(
                "SELECT granted FROM pglock.semaphore_acquire(%s, 1, 'intruder', 1, 600)",
                (name,),
            ).fetchone()
            assert granted == (False,)
            assert permit_rows(admin, name) == before
            # Negative control: the holder's own id renews.
            assert len(
                c.execute(
                    "SELECT * FROM pglock.semaphore_extend(%s, %s, 600)", (name, [real])
                ).fetchall()
            ) == 1
        assert permit_rows(admin, name) != before
        sem.release()
        assert permit_rows(admin, name) == []
    finally:
        sem.close()
