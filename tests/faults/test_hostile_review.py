"""Findings of the hostile review of issue 23, each kept as a test of the fixed behaviour.

- A role with CREATE on the database plants a schema named ``pglock`` (empty, with a table that
  fires a trigger, with functions of its own) before the install: the install refuses it (42501)
  before reading or writing anything in it, and lease statements refuse a schema whose owner the
  calling role cannot trust, or that another role may create objects in (UnsupportedServer).
- A role's ``synchronous_commit = off`` no longer makes lease grants and renewals asynchronous.
- A release in this process hands its grant to a waiter only on the same source: two DSNs that
  look alike (``service=`` entries, which name no host, port or database) may be two databases.
- ``exit_on_error = on`` no longer ends a session on an error pglock's functions catch
  themselves (revision 0005 runs every function with it off).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _pgdb import throwaway_database, with_params
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import pglock
from pglock import _lease

pytestmark = pytest.mark.timeout(90)

MakeRole = Callable[[str], tuple[str, str]]


@pytest.fixture
def fresh_db(pg_dsn: str) -> Iterator[str]:
    with throwaway_database(pg_dsn, prefix="pglock_review") as dsn:
        try:
            yield dsn
        finally:
            _lease.shutdown()


@pytest.fixture
def make_role(pg_dsn: str) -> Iterator[MakeRole]:
    """make_role(dsn) -> (a new LOGIN role, ``dsn`` as that role); dropped afterwards."""
    made: list[str] = []

    def factory(dsn: str) -> tuple[str, str]:
        role = f"rv_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        made.append(role)
        return role, with_params(dsn, user=role)

    yield factory
    _lease.shutdown()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        for role in made:
            with contextlib.suppress(psycopg.Error):
                c.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            with contextlib.suppress(psycopg.Error):
                c.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def grant_app(dsn: str, role: str) -> None:
    """The documented grants (docs/leases.md, Permissions)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("GRANT USAGE ON SCHEMA pglock TO {}").format(sql.Identifier(role)))
        c.execute(sql.SQL("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA pglock TO {}").format(
            sql.Identifier(role)))


def is_superuser(dsn: str, role: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    assert row is not None
    return bool(row[0])


def plant(fresh_db: str, evil_dsn: str, evil: str, what: str) -> None:
    """``evil`` (given CREATE on the database) creates schema pglock, and ``what`` in it."""
    db = conninfo_to_dict(fresh_db)["dbname"]
    with psycopg.connect(fresh_db, autocommit=True) as su:
        su.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
            sql.Identifier(str(db)), sql.Identifier(evil)))
    with psycopg.connect(evil_dsn, autocommit=True) as c:
        c.execute("CREATE SCHEMA pglock")
        c.execute("GRANT USAGE ON SCHEMA pglock TO PUBLIC")
        c.execute("CREATE TABLE pglock.loot (who text)")
        c.execute("GRANT INSERT ON pglock.loot TO PUBLIC")
        # Records who ran it, and makes its owner a superuser when a superuser runs it.
        c.execute(sql.SQL(
            "CREATE FUNCTION pglock.trap() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " INSERT INTO pglock.loot VALUES (current_user);"
            " IF (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) THEN"
            " EXECUTE 'ALTER ROLE {} SUPERUSER'; END IF; RETURN NEW; END $$"
        ).format(sql.Identifier(evil)))
        if what == "trigger":
            c.execute("CREATE TABLE pglock.schema_revision (revision text PRIMARY KEY,"
                      " installed_at timestamptz NOT NULL DEFAULT clock_timestamp())")
            c.execute("CREATE TRIGGER trap BEFORE INSERT ON pglock.schema_revision"
                      " FOR EACH ROW EXECUTE FUNCTION pglock.trap()")
        if what == "functions":
            c.execute(
                "CREATE FUNCTION pglock.acquire_v4(p_name text, p_holder text,"
                " p_ttl double precision, p_metadata jsonb DEFAULT NULL,"
                " p_wait double precision DEFAULT NULL, p_durable boolean DEFAULT true,"
                " p_liveness double precision DEFAULT 1.0)"
                " RETURNS TABLE (granted boolean, holder text, token bigint,"
                " acquired_at timestamptz, expires_at timestamptz, server_time timestamptz,"
                " waiter_id bigint) LANGUAGE plpgsql AS $$ BEGIN"
                " INSERT INTO pglock.loot VALUES (current_user);"
                " RETURN QUERY SELECT true, p_holder, 7::bigint, clock_timestamp(),"
                " clock_timestamp() + interval '1 hour', clock_timestamp(), NULL::bigint;"
                " END $$"
            )


def loot(fresh_db: str) -> list[str]:
    with psycopg.connect(fresh_db, autocommit=True) as c:
        return [r[0] for r in c.execute("SELECT who FROM pglock.loot").fetchall()]


@pytest.mark.parametrize("what", ["empty", "trigger", "functions"])
def test_the_install_refuses_a_schema_another_role_planted(
    fresh_db: str, make_role: MakeRole, what: str
) -> None:
    """Before: the install adopted the planted schema (CREATE ... IF NOT EXISTS), ran its
    trigger as the superuser installing (the planter became a superuser), or left its owner
    free to swap the installer's tables and functions afterwards."""
    evil, evil_dsn = make_role(fresh_db)
    plant(fresh_db, evil_dsn, evil, what)
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not the installing role"):
        pglock.install(fresh_db)
    assert loot(fresh_db) == []
    assert not is_superuser(fresh_db, evil)
    with psycopg.connect(fresh_db, autocommit=True) as c:  # nothing installed into it
        assert c.execute("SELECT to_regclass('pglock.lease')").fetchone() == (None,)


def test_the_install_refuses_a_schema_another_role_may_create_objects_in(
    fresh_db: str, make_role: MakeRole
) -> None:
    other, _ = make_role(fresh_db)
    pglock.install(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as c:
        c.execute(sql.SQL("GRANT CREATE ON SCHEMA pglock TO {}").format(sql.Identifier(other)))
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not the installing role"):
        pglock.install(fresh_db)  # an upgrade would run in a schema another role can fill


def test_leases_refuse_a_planted_schema_and_run_nothing_of_it(
    fresh_db: str, make_role: MakeRole
) -> None:
    """No pglock install: a planted schema with an acquire_v4 of its own. Before: the
    application's acquire() ran it and believed its grant (token 7)."""
    evil, evil_dsn = make_role(fresh_db)
    _, app_dsn = make_role(fresh_db)
    plant(fresh_db, evil_dsn, evil, "functions")
    lease = pglock.lease(app_dsn, "job:1", ttl=5, keepalive=False)
    with pytest.raises(pglock.UnsupportedServer, match="does not use schema 'pglock'"):
        lease.acquire(timeout=0)
    assert loot(fresh_db) == [] and not lease.locked


def test_an_install_by_the_database_owner_or_a_superuser_is_trusted(
    fresh_db: str, make_role: MakeRole
) -> None:
    """The usual set-ups: the database's owner installs (a migration role), the application
    role has the documented grants and uses leases; then a superuser's upgrade."""
    owner, owner_dsn = make_role(fresh_db)
    app, app_dsn = make_role(fresh_db)
    db = conninfo_to_dict(fresh_db)["dbname"]
    with psycopg.connect(fresh_db, autocommit=True) as su:
        su.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(
            sql.Identifier(str(db)), sql.Identifier(owner)))
    assert pglock.install(owner_dsn)
    grant_app(owner_dsn, app)
    with pglock.lease(app_dsn, "job:1", ttl=5) as lease:
        assert lease.token is not None
    assert pglock.install(owner_dsn) == []  # up to date, re-checked


def test_lease_grants_are_durable_whatever_the_roles_synchronous_commit(
    fresh_db: str, make_role: MakeRole
) -> None:
    """Before: under ALTER ROLE ... SET synchronous_commit = off, lease grants and renewals
    committed asynchronously (a crash could forget an acknowledged grant and hand its token
    out again). Semaphore grants are the control."""
    pglock.install(fresh_db)
    app, app_dsn = make_role(fresh_db)
    grant_app(fresh_db, app)
    with psycopg.connect(fresh_db, autocommit=True) as su:
        su.execute(sql.SQL("ALTER ROLE {} SET synchronous_commit = off").format(
            sql.Identifier(app)))
        su.execute("CREATE TABLE public.commit_log (what text, token bigint, sc text)")
        su.execute(
            "CREATE FUNCTION public.log_sc() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " INSERT INTO public.commit_log VALUES (TG_TABLE_NAME || ':' || TG_OP,"
            " (to_jsonb(NEW) ->> 'token')::bigint, current_setting('synchronous_commit'));"
            " RETURN NEW; END $$"
        )
        for table in ("pglock.lease", "pglock.semaphore_permit"):
            su.execute(f"CREATE TRIGGER log_sc AFTER INSERT OR UPDATE ON {table}"
                       " FOR EACH ROW EXECUTE FUNCTION public.log_sc()")
    with pglock.lease(app_dsn, "job:sc", ttl=30, keepalive=False) as lease:
        lease.extend()
    with pglock.semaphore(app_dsn, "sem:sc", 2, ttl=30):
        pass
    with psycopg.connect(fresh_db, autocommit=True) as su:
        log = su.execute("SELECT what, token, sc FROM public.commit_log").fetchall()
    grants = [r for r in log if r[0].startswith("lease") and r[1]]
    permits = [r for r in log if r[0].startswith("semaphore_permit")]
    assert permits and all(sc == "on" for _, _, sc in permits), log
    assert grants and all(sc == "on" for _, _, sc in grants), grants


HOLDER = "worker@host-1"


@pytest.fixture
def two_services(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, str]]:
    params = conninfo_to_dict(pg_dsn)
    if str(params.get("host", "")).startswith("/"):
        pytest.skip("a socket-directory DSN: the service file below names a TCP host")
    with contextlib.ExitStack() as stack:
        dbs = [stack.enter_context(throwaway_database(pg_dsn, prefix="pglock_svc"))
               for _ in range(2)]
        lines = []
        for svc, dsn in zip(("shard_a", "shard_b"), dbs, strict=True):
            p = conninfo_to_dict(dsn)
            lines += [f"[{svc}]", f"host={p.get('host', '127.0.0.1')}",
                      f"port={p.get('port', '5432')}", f"user={p.get('user', 'postgres')}",
                      f"dbname={p['dbname']}", ""]
        path = tmp_path / "pg_service.conf"
        path.write_text("\n".join(lines))
        monkeypatch.setenv("PGSERVICEFILE", str(path))
        for svc in ("shard_a", "shard_b"):
            pglock.install(f"service={svc}")
        try:
            yield "service=shard_a", "service=shard_b"
        finally:
            _lease.shutdown()


def test_a_handoff_goes_to_a_waiter_only_on_the_releases_source(
    two_services: tuple[str, str],
) -> None:
    """Two databases named by service entries look alike to pglock (no host, port or database
    is written). A release in A hands its grant to A's waiter (another process, same holder
    id, waiter id 1); this process's waiter on B (holder id and waiter id 1 too) must not
    believe it. Before: it returned True with A's token while B's row named B's holder."""
    a, b = two_services
    b_holder = pglock.lease(b, "job:42", ttl=30)
    assert b_holder.acquire(timeout=0)
    b_waiter = pglock.lease(b, "job:42", ttl=30, holder=HOLDER)
    result: dict[str, object] = {}
    t = threading.Thread(target=lambda: result.setdefault("granted", b_waiter.acquire(timeout=6)))
    t.start()
    a_holder = pglock.lease(a, "job:42", ttl=30)
    assert a_holder.acquire(timeout=0)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import pglock,sys; l=pglock.lease(sys.argv[1],'job:42',ttl=30,holder=sys.argv[2]);"
         "ok=l.acquire(timeout=8); print(ok, flush=True);"
         "import time; time.sleep(1); l.release() if ok else None", a, HOLDER],
        env=os.environ, stdout=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 10
        for dsn in (b, a):
            with psycopg.connect(dsn, autocommit=True) as c:
                while not c.execute("SELECT count(*) FROM pglock.lease_waiter").fetchone()[0]:
                    assert time.monotonic() < deadline, "a waiter never queued"
                    time.sleep(0.02)
                assert c.execute("SELECT id FROM pglock.lease_waiter").fetchone() == (1,)
        a_holder.release()  # hands A's lease to the other process's waiter (id 1, HOLDER)
        t.join(10)
        assert result == {"granted": False}
        with psycopg.connect(b, autocommit=True) as c:
            row = c.execute("SELECT holder, token FROM pglock.lease WHERE name = 'job:42'"
                            " AND expires_at > clock_timestamp()").fetchone()
        assert row == (b_holder.holder, b_holder.token)
        out, _ = child.communicate(timeout=20)
        assert out.strip() == "True"
    finally:
        if child.poll() is None:
            child.kill()
        t.join(10)
        for h in (b_waiter, b_holder):
            with contextlib.suppress(Exception):
                if h.locked or h.lost:
                    h.release()


def test_exit_on_error_keeps_a_queued_waiter_served(db_with_schema: str) -> None:
    """Under exit_on_error = on, the errors the lease functions catch themselves (take_over_v4's
    FOR UPDATE NOWAIT behind a guard()) ended the waiter's session; its acquire() raised
    LockNotAvailable though the lease became free within its timeout."""
    db = db_with_schema
    old = pglock.lease(db, "job:eoe", ttl=1.5, keepalive=False)
    assert old.acquire(timeout=0)
    waiter = pglock.lease(with_params(db, options="-c exit_on_error=on"), "job:eoe", ttl=5)
    outcome: dict[str, Any] = {}

    def take() -> None:
        try:
            outcome["granted"] = waiter.acquire(timeout=8)
        except BaseException as exc:
            outcome["raised"] = repr(exc)

    guard_conn = psycopg.connect(db)
    t = threading.Thread(target=take)
    try:
        with guard_conn.transaction():
            old.guard(guard_conn)
            t.start()  # queues behind the live lease, which expires at 1.5 s
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # the guard holds it past its expiry
                time.sleep(0.05)
        t.join(15)
        assert outcome == {"granted": True}
    finally:
        guard_conn.close()
        t.join(15)
        for h in (waiter, old):
            with contextlib.suppress(Exception):
                if h.locked or h.lost:
                    h.release()


@pytest.fixture
def db_with_schema(fresh_db: str) -> str:
    pglock.install(fresh_db)
    return fresh_db
