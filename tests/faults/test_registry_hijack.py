"""The name registry cannot be hijacked (issue 11 item 3).

pglock records ``(key, name)`` in ``<schema>.lock_names`` when it takes a lock, and reads it
back for :func:`pglock.advisory_locks` and ``pglock status``. An INSERT into a table runs that
table's triggers as the inserting role, and a read runs its row-security policies, so the
registry pglock writes to and reads from must be pglock's own. Each test plants a look-alike
registry (the table name, the marker comment, ``INSERT`` granted to ``PUBLIC``, and a trigger
that copies a table only the victim can read, and records ``current_user``, into the
attacker's ``loot`` table) as a real second role that has only ``CREATE`` on the database:

* in a schema of its own, next to the genuine pglock schema: never written, never read, by a
  role with the registry grants (which gets the genuine registry) or without them (none);
* in a database without the pglock schema: nothing written anywhere, also by
  ``pglock.alembic.migration_lock`` run as the superuser;
* as a schema named ``pglock`` in a database without one: neither written nor read, by the
  victim or by the superuser;
* names planted in a look-alike never show in ``pglock.advisory_locks()`` or ``pglock status``;
* the genuine registry with a trigger (or row security) added by its owner is not used either.

Every test runs in a throwaway database of its own; the roles are dropped afterwards.
"""

from __future__ import annotations

import contextlib
import io
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from _pgdb import drop_roles, throwaway_database, with_params
from psycopg import sql

import pglock
from pglock import cli
from pglock.alembic import migration_lock

pytestmark = pytest.mark.timeout(60)

SECRET = "only-the-victim-may-read-this"


@dataclass(frozen=True)
class Roles:
    attacker: str  # CREATE on the database, nothing else
    victim: str  # the documented registry grants, and SELECT on the secret
    bystander: str  # no registry grant (the docs make it optional), SELECT on the secret


@pytest.fixture
def roles(pg_dsn: str) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:8]
    made = Roles(f"pglock_att_{tag}", f"pglock_vic_{tag}", f"pglock_bys_{tag}")
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        for role in (made.attacker, made.victim, made.bystander):
            admin.execute(
                sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE").format(
                    sql.Identifier(role)
                )
            )
    try:
        yield made
    finally:
        # The databases (and so every object and grant of these roles) are gone by now: the
        # database fixtures depend on this one and are torn down first.
        drop_roles(pg_dsn, (made.attacker, made.victim, made.bystander))


def _prepare(dsn: str, roles: Roles, *, installed: bool) -> None:
    """As the superuser: the attacker may create schemas, the victims may read the secret,
    and (when the pglock schema is installed) the victim has the documented registry grants
    while the bystander has only what leases need."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        ident = sql.Identifier
        db = admin.info.dbname
        admin.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(ident(db), ident(roles.attacker))
        )
        admin.execute("CREATE TABLE public.secret (v text)")
        admin.execute("INSERT INTO public.secret VALUES (%s)", (SECRET,))
        admin.execute(
            sql.SQL("GRANT SELECT ON public.secret TO {}, {}").format(
                ident(roles.victim), ident(roles.bystander)
            )
        )
        if installed:
            for role in (roles.victim, roles.bystander):
                admin.execute(sql.SQL("GRANT USAGE ON SCHEMA pglock TO {}").format(ident(role)))
                admin.execute(
                    sql.SQL("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA pglock TO {}").format(
                        ident(role)
                    )
                )
            admin.execute(
                sql.SQL("GRANT SELECT, INSERT ON pglock.lock_names TO {}").format(
                    ident(roles.victim)
                )
            )


@pytest.fixture
def installed_db(pg_dsn: str, roles: Roles) -> Iterator[str]:
    """A fresh database with the genuine pglock schema (installed by the superuser)."""
    with throwaway_database(pg_dsn, prefix="pglock_hijack", install=True) as dsn:
        _prepare(dsn, roles, installed=True)
        yield dsn


@pytest.fixture
def bare_db(pg_dsn: str, roles: Roles) -> Iterator[str]:
    """A fresh database without the pglock schema."""
    with throwaway_database(pg_dsn, prefix="pglock_hijack", install=False) as dsn:
        _prepare(dsn, roles, installed=False)
        yield dsn


# The trigger records who ran it, then tries to copy the secret: as the victim both rows land.
_PLANT = [
    "CREATE SCHEMA {s}",
    "CREATE TABLE {s}.lock_names (key bigint PRIMARY KEY, name text NOT NULL,"
    " first_seen timestamptz NOT NULL DEFAULT clock_timestamp())",
    "COMMENT ON TABLE {s}.lock_names IS 'pglock name registry: the lock name of each"
    " advisory-lock key that pglock took in this database (pglock status, pglock.advisory_locks)'",
    "CREATE TABLE {s}.loot (who text, secret text)",
    "CREATE FUNCTION {s}.steal() RETURNS trigger LANGUAGE plpgsql AS $body$"
    " BEGIN"
    "  INSERT INTO {s}.loot VALUES (current_user, NULL);"
    "  BEGIN"
    "   INSERT INTO {s}.loot SELECT current_user, v FROM public.secret;"
    "  EXCEPTION WHEN insufficient_privilege THEN NULL;"
    "  END;"
    "  RETURN NEW;"
    " END $body$",
    "GRANT USAGE ON SCHEMA {s} TO PUBLIC",
    "GRANT SELECT, INSERT ON {s}.lock_names TO PUBLIC",
    "GRANT INSERT ON {s}.loot TO PUBLIC",
]
_ARM = (
    "CREATE TRIGGER steal BEFORE INSERT ON {s}.lock_names"
    " FOR EACH ROW EXECUTE FUNCTION {s}.steal()"
)


def plant(dsn: str, attacker: str, schema: str, names: dict[int, str] | None = None) -> None:
    """As ``attacker``: a look-alike registry in ``schema`` holding ``names`` (key -> name),
    with the stealing trigger armed."""
    s = sql.Identifier(schema)
    with psycopg.connect(with_params(dsn, user=attacker), autocommit=True) as c:
        for stmt in _PLANT:
            c.execute(sql.SQL(stmt).format(s=s))
        for k, n in (names or {}).items():
            c.execute(
                sql.SQL("INSERT INTO {}.lock_names (key, name) VALUES (%s, %s)").format(s), (k, n)
            )
        c.execute(sql.SQL(_ARM).format(s=s))


def loot(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    """What the planted trigger captured (read as the superuser)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return c.execute(
            sql.SQL("SELECT who, secret FROM {}.loot ORDER BY who, secret").format(
                sql.Identifier(schema)
            )
        ).fetchall()


def registry_rows(dsn: str) -> dict[str, list[str]]:
    """Every ``lock_names`` table in the database, by schema, with its names."""
    with psycopg.connect(dsn, autocommit=True) as c:
        schemas = [
            r[0]
            for r in c.execute(
                "SELECT n.nspname FROM pg_class t JOIN pg_namespace n ON n.oid = t.relnamespace"
                " WHERE t.relname = 'lock_names' ORDER BY 1"
            )
        ]
        return {
            s: [
                r[0]
                for r in c.execute(
                    sql.SQL("SELECT name FROM {}.lock_names ORDER BY name").format(
                        sql.Identifier(s)
                    )
                )
            ]
            for s in schemas
        }


def uniq(prefix: str = "hijack") -> str:
    return f"{prefix}:{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def session(dsn: str, app_name: str, user: str | None = None) -> Iterator[psycopg.Connection[Any]]:
    params: dict[str, Any] = {"application_name": app_name}
    if user is not None:
        params["user"] = user
    with psycopg.connect(with_params(dsn, **params), autocommit=True) as c:
        yield c


def lock_every_way(c: psycopg.Connection[Any], prefix: str) -> list[str]:
    """Take a session lock, two at once, a timed one and a transaction lock; return the names."""
    names = [uniq(prefix) for _ in range(5)]
    with pglock.pg_lock(c, names[0]):
        pass
    with pglock.pg_lock(c, names[1:3]):
        pass
    with pglock.pg_lock(c, names[3], timeout=1):
        pass
    with c.transaction():
        pglock.xact_lock(c, names[4])
    return names


def status_json(dsn: str, *names: str, schema: str | None = None) -> dict[str, Any]:
    """``pglock status --json`` run in this process."""
    out = io.StringIO()
    args = ["status", "--dsn", dsn, "--json", *names]
    if schema is not None:
        args += ["--schema", schema]
    with contextlib.redirect_stdout(out):
        assert cli.main(args) == 0
    doc: dict[str, Any] = json.loads(out.getvalue())
    return doc


# --- (a) a look-alike next to the genuine schema ------------------------------------------------


def test_a_planted_registry_in_another_schema_is_never_written(
    installed_db: str, roles: Roles, app_name: str
) -> None:
    """Fails on main: the bystander (USAGE and EXECUTE, no registry grant, as the docs allow)
    wrote its names into the planted table, whose trigger ran as the bystander and copied the
    secret. The victim (registry grants) already used the genuine table."""
    evil = f"evil_{uuid.uuid4().hex[:8]}"
    plant(installed_db, roles.attacker, evil)
    with session(installed_db, app_name, roles.victim) as c:
        victim_names = lock_every_way(c, "victim")
    with session(installed_db, app_name, roles.bystander) as c:
        lock_every_way(c, "bystander")
    assert loot(installed_db, evil) == []
    assert registry_rows(installed_db) == {evil: [], "pglock": sorted(victim_names)}


# --- (b) a database without the pglock schema ----------------------------------------------------


def test_b_without_the_pglock_schema_nothing_is_registered_anywhere(
    bare_db: str, roles: Roles, app_name: str
) -> None:
    """Fails on main: the victim's locks, and ``migration_lock`` run as the superuser, wrote
    into the planted table, running its trigger as the victim and as the superuser."""
    evil = f"evil_{uuid.uuid4().hex[:8]}"
    plant(bare_db, roles.attacker, evil)
    with session(bare_db, app_name, roles.victim) as c:
        lock_every_way(c, "victim")
    with session(bare_db, app_name) as c:  # the superuser, through the same API
        lock_every_way(c, "superuser")
    with migration_lock(with_params(bare_db, application_name=app_name), uniq("migrate")):
        pass
    assert loot(bare_db, evil) == []
    assert registry_rows(bare_db) == {evil: []}


# --- (c) a schema named pglock, created by the attacker ----------------------------------------


def test_c_a_pglock_schema_owned_by_an_untrusted_role_is_neither_written_nor_read(
    bare_db: str, roles: Roles, app_name: str
) -> None:
    """Fails on main: a schema called ``pglock`` created by a role with CREATE on the database
    was taken for the registry by every role, the superuser included."""
    held = uniq("held")
    plant(bare_db, roles.attacker, "pglock", {pglock.key(held): "planted-by-the-attacker"})
    with session(bare_db, app_name, roles.victim) as c:
        lock_every_way(c, "victim")
        with pglock.pg_lock(c, held):
            (lk,) = pglock.advisory_locks(c, held)
            assert lk.name is None and lk.label == f"key {pglock.key(held)}"
            with session(bare_db, app_name) as su:
                (lk,) = pglock.advisory_locks(su, held)
                assert lk.name is None
    with session(bare_db, app_name) as c:
        lock_every_way(c, "superuser")
    with migration_lock(with_params(bare_db, application_name=app_name), uniq("migrate")):
        pass
    assert loot(bare_db, "pglock") == []
    assert registry_rows(bare_db) == {"pglock": ["planted-by-the-attacker"]}


# --- (d) names shown by advisory_locks and pglock status -----------------------------------------


@pytest.mark.parametrize("installed", [False, True], ids=["bare", "installed"])
def test_d_names_planted_in_a_look_alike_are_never_shown(
    installed: bool, pg_dsn: str, roles: Roles, app_name: str
) -> None:
    """Fails on main: ``advisory_locks()`` and ``pglock status`` showed the attacker's name for
    the bystander's lock (no pglock schema, or one the observer may not read)."""
    with throwaway_database(pg_dsn, prefix="pglock_hijack", install=installed) as dsn:
        _prepare(dsn, roles, installed=installed)
        evil = f"evil_{uuid.uuid4().hex[:8]}"
        name = uniq("shown")
        plant(dsn, roles.attacker, evil, {pglock.key(name): "planted-by-the-attacker"})
        observer_dsn = with_params(dsn, user=roles.bystander, application_name=app_name)
        with session(dsn, app_name, roles.bystander) as c, pglock.pg_lock(c, name):
            (lk,) = pglock.advisory_locks(c, name)
            assert lk.name is None
            (lk,) = pglock.advisory_locks(c, name, schema=evil)
            assert lk.name is None
            doc = status_json(observer_dsn, name)
            assert [lk["name"] for lk in doc["advisory_locks"]] == [None]
            doc = status_json(observer_dsn, name, schema=evil)
            assert [lk["name"] for lk in doc["advisory_locks"]] == [None]
        assert loot(dsn, evil) == []


# --- defence in depth: the genuine table, altered -------------------------------------------------


def test_the_genuine_registry_with_a_trigger_or_row_security_is_not_used(
    installed_db: str, roles: Roles, app_name: str
) -> None:
    """Fails on main: a trigger on the genuine table (added by its owner) ran for every lock.
    The registry pglock installs has no trigger, rule or row security, and is used (control)."""
    with session(installed_db, app_name, roles.victim) as c:
        before = lock_every_way(c, "before")
    assert registry_rows(installed_db)["pglock"] == sorted(before)
    with psycopg.connect(installed_db, autocommit=True) as admin:
        admin.execute("CREATE TABLE pglock.audit (who text)")
        admin.execute(
            "CREATE FUNCTION pglock.audit() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN INSERT INTO pglock.audit VALUES (current_user); RETURN NEW; END $$"
        )
        admin.execute(
            "CREATE TRIGGER audit BEFORE INSERT ON pglock.lock_names"
            " FOR EACH ROW EXECUTE FUNCTION pglock.audit()"
        )
        admin.execute("GRANT INSERT ON pglock.audit TO PUBLIC")
    with session(installed_db, app_name, roles.victim) as c:
        lock_every_way(c, "trigger")
    with psycopg.connect(installed_db, autocommit=True) as admin:
        assert admin.execute("SELECT count(*) FROM pglock.audit").fetchone() == (0,)
        admin.execute("DROP TABLE pglock.lock_names")
        admin.execute(
            "CREATE TABLE pglock.lock_names (key bigint PRIMARY KEY, name text NOT NULL,"
            " first_seen timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        admin.execute("COMMENT ON TABLE pglock.lock_names IS 'pglock name registry'")
        admin.execute(
            sql.SQL("GRANT SELECT, INSERT ON pglock.lock_names TO {}").format(
                sql.Identifier(roles.victim)
            )
        )
        name = uniq("rls")
        admin.execute(
            "INSERT INTO pglock.lock_names (key, name) VALUES (%s, 'visible-through-a-policy')",
            (pglock.key(name),),
        )
        admin.execute("ALTER TABLE pglock.lock_names ENABLE ROW LEVEL SECURITY")
        admin.execute("CREATE POLICY everyone ON pglock.lock_names USING (true) WITH CHECK (true)")
    with session(installed_db, app_name, roles.victim) as c:
        lock_every_way(c, "rls")
        with pglock.pg_lock(c, name):
            (lk,) = pglock.advisory_locks(c, name)
            assert lk.name is None
    assert registry_rows(installed_db)["pglock"] == ["visible-through-a-policy"]
