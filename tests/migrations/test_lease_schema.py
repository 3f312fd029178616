"""The pglock schema: Alembic round trips, custom schemas, concurrent installs, the CLI.

Every test works in a new, empty database of its own (dropped afterwards).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _pgdb import sa_url, throwaway_database, with_params
from psycopg import sql

import pglock
from pglock import _lease, _schema
from pglock.migrations import VERSIONS_DIR

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
LEASE_FUNCTIONS = ("acquire", "extend", "extend_many", "guard", "info", "leases", "release")


@contextlib.contextmanager
def empty_database(pg_dsn: str) -> Iterator[str]:
    """A new, empty database next to the test one; its libpq DSN. Dropped afterwards."""
    with throwaway_database(pg_dsn, prefix="pglock_schema") as dsn:
        try:
            yield dsn
        finally:
            _lease.shutdown()


@pytest.fixture
def db(pg_dsn: str, app_name: str) -> Iterator[str]:
    with empty_database(pg_dsn) as dsn:
        yield with_params(dsn, application_name=app_name)


def env() -> dict[str, str]:
    e = {**os.environ, "PYTHONPATH": str(ROOT)}
    e.pop("PGLOCK_DSN", None)
    return e


def run(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env(), capture_output=True, text=True,
        timeout=timeout,
    )


def alembic(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    done = run("-m", "alembic", *args, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done


def objects(dsn: str, schema: str = "pglock") -> dict[str, Any]:
    """What exists of the lease schema: counts, so that duplicates would show."""
    with psycopg.connect(dsn, autocommit=True) as c:
        def one(query: str, *params: Any) -> Any:
            row = c.execute(query, params).fetchone()
            assert row is not None
            return row[0]

        funcs = dict(
            c.execute(
                "SELECT p.proname, count(*) FROM pg_proc p JOIN pg_namespace n"
                " ON n.oid = p.pronamespace WHERE n.nspname = %s GROUP BY p.proname",
                (schema,),
            ).fetchall()
        )
        return {
            "schema": one("SELECT count(*) FROM pg_namespace WHERE nspname = %s", schema),
            "lease": one(
                "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relname = 'lease' AND c.relkind = 'r'", schema,
            ),
            "sequence": one(
                "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relname = 'lease_token' AND c.relkind = 'S'",
                schema,
            ),
            "functions": {f: funcs.get(f, 0) for f in LEASE_FUNCTIONS},
            "revisions": [
                r[0]
                for r in c.execute(
                    sql.SQL("SELECT revision FROM {}.schema_revision ORDER BY revision").format(
                        sql.Identifier(schema)
                    )
                ).fetchall()
            ]
            if one("SELECT to_regclass(%s) IS NOT NULL", f"{schema}.schema_revision")
            else [],
        }


def installed_once(schema: str = "pglock") -> dict[str, Any]:
    return {
        "schema": 1,
        "lease": 1,
        "sequence": 1,
        "functions": dict.fromkeys(LEASE_FUNCTIONS, 1),
        "revisions": sorted(r.revision for r in _schema.revisions()),
    }


ABSENT = {
    "schema": 0, "lease": 0, "sequence": 0,
    "functions": dict.fromkeys(LEASE_FUNCTIONS, 0), "revisions": [],
}


def lease_works(dsn: str, schema: str = "pglock") -> int:
    with pglock.lease(dsn, f"check:{uuid.uuid4()}", ttl=5, timeout=0, schema=schema) as lease:
        assert lease.token is not None
        return lease.token


# --- Alembic ----------------------------------------------------------------------------------


def test_alembic_upgrade_downgrade_upgrade_on_an_empty_database(db: str) -> None:
    # acceptance: upgrade -> downgrade -> upgrade on an empty database
    assert objects(db) == ABSENT
    alembic("-x", f"dsn={db}", "upgrade", "head")
    assert objects(db) == installed_once()
    first = lease_works(db)

    alembic("-x", f"dsn={db}", "downgrade", "base")
    assert objects(db) == ABSENT
    with psycopg.connect(db, autocommit=True) as c:
        assert c.execute("SELECT count(*) FROM alembic_version").fetchone() == (0,)

    alembic("-x", f"dsn={db}", "upgrade", "head")
    assert objects(db) == installed_once()
    assert lease_works(db) >= 1 and first >= 1
    current = alembic("-x", f"dsn={db}", "current").stdout
    assert _schema.head() in current


def test_alembic_installs_into_a_custom_schema(db: str) -> None:
    alembic("-x", f"dsn={db}", "-x", "schema=tenant_locks", "upgrade", "pglock@head")
    assert objects(db, "tenant_locks") == installed_once("tenant_locks")
    assert objects(db)["schema"] == 0
    lease_works(db, "tenant_locks")
    with psycopg.connect(db, autocommit=True) as c:
        configs = c.execute(
            "SELECT p.proname, p.proconfig FROM pg_proc p JOIN pg_namespace n"
            " ON n.oid = p.pronamespace WHERE n.nspname = 'tenant_locks'"
            " AND p.proname = ANY(%s)",
            (list(LEASE_FUNCTIONS),),
        ).fetchall()
    assert len(configs) == len(LEASE_FUNCTIONS)
    for proname, config in configs:
        assert config is not None, proname
        assert any(re.fullmatch(r'search_path="?pg_catalog"?, "?tenant_locks"?, "?pg_temp"?', c)
                   for c in config), (proname, config)
    alembic("-x", f"dsn={db}", "-x", "schema=tenant_locks", "downgrade", "base")
    assert objects(db, "tenant_locks") == ABSENT


def test_alembic_offline_mode_prints_the_sql() -> None:
    done = alembic("upgrade", "head", "--sql")
    out = done.stdout
    assert 'CREATE OR REPLACE FUNCTION "pglock".acquire(' in out
    assert "pg_advisory_xact_lock" in out and "clock_timestamp()" in out
    assert "INSERT INTO alembic_version" in out


USER_ENV = textwrap.dedent(
    '''
    """A user's own env.py: the recipe of docs/leases.md."""
    from alembic import context
    from sqlalchemy import create_engine, pool

    config = context.config


    def run_migrations_online() -> None:
        engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
        with engine.connect() as connection:
            context.configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()


    run_migrations_online()
    '''
)

USER_REVISION = textwrap.dedent(
    '''
    """The application's own first revision."""
    from alembic import op

    revision = "app_0001"
    down_revision = None
    branch_labels = ("app",)
    depends_on = None


    def upgrade() -> None:
        op.execute("CREATE TABLE app_things (id int PRIMARY KEY)")


    def downgrade() -> None:
        op.execute("DROP TABLE app_things")
    '''
)


def test_a_users_alembic_applies_pglock_with_version_locations(db: str, tmp_path: Path) -> None:
    # The documented recipe: pglock's versions directory in version_locations, then
    # `alembic upgrade pglock@head` (or `heads`, which includes it).
    (tmp_path / "migrations" / "versions").mkdir(parents=True)
    (tmp_path / "migrations" / "env.py").write_text(USER_ENV)
    (tmp_path / "migrations" / "versions" / "app_0001.py").write_text(USER_REVISION)
    # The test database's URL, a Unix-socket host included; ConfigParser needs "%" doubled.
    url = sa_url(db).render_as_string(hide_password=False).replace("%", "%%")
    (tmp_path / "alembic.ini").write_text(
        textwrap.dedent(
            f"""
            [alembic]
            script_location = %(here)s/migrations
            path_separator = os
            version_locations = %(here)s/migrations/versions{os.pathsep}{VERSIONS_DIR}
            sqlalchemy.url = {url}
            """
        )
    )
    alembic("upgrade", "pglock@head", cwd=tmp_path)
    assert objects(db) == installed_once()
    with psycopg.connect(db, autocommit=True) as c:
        assert c.execute("SELECT to_regclass('app_things')").fetchone() == (None,)
    lease_works(db)
    alembic("upgrade", "heads", cwd=tmp_path)
    with psycopg.connect(db, autocommit=True) as c:
        assert c.execute("SELECT to_regclass('app_things')").fetchone() == ("app_things",)
        heads = sorted(r[0] for r in c.execute("SELECT version_num FROM alembic_version"))
    assert heads == sorted(["app_0001", _schema.head()])
    alembic("downgrade", "pglock@base", cwd=tmp_path)
    assert objects(db) == ABSENT
    # Into another schema with -x pglock_schema=..., from the same project.
    alembic("-x", "pglock_schema=other_locks", "upgrade", "pglock@head", cwd=tmp_path)
    assert objects(db, "other_locks") == installed_once("other_locks")
    lease_works(db, "other_locks")


# --- pglock install ---------------------------------------------------------------------------


def test_five_concurrent_pglock_install_runs_all_succeed_and_objects_exist_once(db: str) -> None:
    # acceptance: five concurrent `pglock install` runs on an empty database all succeed and
    # the objects exist once
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pglock", "install", "--dsn", db],
            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(5)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 5, outs
    assert sum("installed schema 'pglock'" in out for out, _ in outs) == 1, outs
    assert sum("up to date" in out for out, _ in outs) == 4, outs
    assert objects(db) == installed_once()
    lease_works(db)


def test_concurrent_cli_installs_and_alembic_upgrades_mix_safely(db: str) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pglock", "install", "--dsn", db],
            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ] + [
        subprocess.Popen(
            [sys.executable, "-m", "alembic", "-x", f"dsn={db}", "upgrade", "head"],
            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    assert objects(db) == installed_once()


def test_install_twice_changes_nothing_and_keeps_leases(db: str) -> None:
    assert _schema.install(db) == [r.revision for r in _schema.revisions()]
    with pglock.lease(db, "kept", ttl=30) as lease:
        assert _schema.install(db) == []
        with psycopg.connect(db) as c:
            assert _schema.install(c) == []
            assert _schema.installed_revisions(c) == sorted(
                r.revision for r in _schema.revisions()
            )
        info = pglock.lease_info(db, "kept")
        assert info is not None and info.token == lease.token


def test_public_install_applies_every_revision_once(db: str) -> None:
    """``pglock.install`` (what ``pglock install`` runs) on a fresh database."""
    every = [r.revision for r in _schema.revisions()]
    assert pglock.install(db) == every
    assert pglock.install(db) == []
    with psycopg.connect(db, autocommit=True) as c:
        assert pglock.install(c, schema="other_locks") == every
        assert pglock.install(c, schema="other_locks") == []
    assert objects(db) == installed_once()
    assert objects(db, "other_locks") == installed_once("other_locks")


def test_install_refuses_bad_input_before_connecting(db: str) -> None:
    unreachable = "postgresql://nobody@127.0.0.1:1/nothing"
    for bad in ("Bad", "a.b", "", "x" * 64, "pg_toast", 'p"; DROP SCHEMA public; --'):
        with pytest.raises(ValueError):
            _schema.install(unreachable, schema=bad)
    with pytest.raises(TypeError):
        _schema.install(unreachable, schema=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _schema.install(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        _schema.install("  ")
    with psycopg.connect(db) as c:
        c.execute("SELECT 1")
        with pytest.raises(ValueError):
            _schema.install(c)
        c.rollback()
    assert objects(db) == ABSENT


def test_cli_errors_are_one_line_with_documented_exit_codes(db: str) -> None:
    ok = run("-m", "pglock", "install", "--dsn", db, "--schema", "cli_locks")
    assert ok.returncode == 0 and "installed schema 'cli_locks'" in ok.stdout
    again = run("-m", "pglock", "install", "--dsn", db, "--schema", "cli_locks")
    assert again.returncode == 0 and "up to date" in again.stdout
    assert objects(db, "cli_locks") == installed_once("cli_locks")

    cases = [
        (("install", "--dsn", db, "--schema", "Bad"), 2, "invalid schema name"),
        (("install",), 2, "PGLOCK_DSN"),
        (("install", "--bogus"), 2, "unrecognized arguments"),
        (("frobnicate",), 2, "invalid choice"),
        (("install", "--dsn", "postgresql://nobody@127.0.0.1:1/x"), 1, "connection"),
        (("install", "--dsn", "this is not a dsn"), 1, "error"),
    ]
    for args, code, text in cases:
        done = run("-m", "pglock", *args)
        assert done.returncode == code, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, (args, done.stderr)
        assert lines[0].startswith("pglock: error:") and text in lines[0], (args, lines)
        assert "Traceback" not in done.stderr

    from_env = subprocess.run(
        [sys.executable, "-m", "pglock", "install", "--schema", "env_locks"],
        cwd=ROOT, env={**env(), "PGLOCK_DSN": db}, capture_output=True, text=True, timeout=60,
    )
    assert from_env.returncode == 0, from_env.stderr
    assert objects(db, "env_locks") == installed_once("env_locks")
    version = run("-m", "pglock", "--version")
    assert version.returncode == 0 and pglock.__version__ in version.stdout


# --- safety of the installed functions ---------------------------------------------------------


def test_installed_functions_resist_search_path_hijacking(db: str) -> None:
    _schema.install(db)
    with psycopg.connect(db, autocommit=True) as c:
        # An attacker (or an accident) shadows the table and clock_timestamp() in schemas that
        # come first on this session's search_path.
        c.execute("CREATE SCHEMA evil")
        c.execute(
            "CREATE TABLE evil.lease (LIKE pglock.lease INCLUDING ALL)"
        )
        c.execute(
            "CREATE FUNCTION evil.clock_timestamp() RETURNS timestamptz LANGUAGE sql"
            " AS $$ SELECT timestamptz '2000-01-01' $$"
        )
        c.execute("CREATE TEMP TABLE lease (LIKE pglock.lease INCLUDING ALL)")
        c.execute("SET search_path = pg_temp, evil, public")
        row = c.execute(
            "SELECT granted, expires_at > pg_catalog.clock_timestamp()"
            " FROM pglock.acquire('hijack', 'me', 30)"
        ).fetchone()
        assert row == (True, True)
        assert c.execute("SELECT count(*) FROM pg_temp.lease").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM evil.lease").fetchone() == (0,)
        assert c.execute(
            "SELECT count(*) FROM pglock.lease WHERE name = 'hijack'"
        ).fetchone() == (1,)


def test_the_shipped_revisions_form_one_linear_branch() -> None:
    revs = _schema.revisions()
    assert revs[0].revision == "pglock_0001" and revs[0].down_revision is None
    assert revs[0].module.branch_labels == ("pglock",)
    for before, after in itertools.pairwise(revs):
        assert after.down_revision == before.revision
    for rev in revs:
        for schema in ("pglock", "other"):
            up = rev.upgrade_statements(schema)
            assert up and "pg_advisory_xact_lock" in up[0].as_string(None)
    assert _schema.head() == revs[-1].revision
