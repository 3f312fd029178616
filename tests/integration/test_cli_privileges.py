"""``pglock status`` as roles with fewer privileges than the owner.

Real roles in a throwaway database: the monitoring grants of docs/leases.md (read from the docs),
the grants that page's table listed for monitoring before it named ``leases()`` (no EXECUTE on
it), and no grant at all. Advisory locks need no grant, so status shows them to every role and
exits 0; each section the role may not read says so, with the GRANT that shows it, and running
that GRANT does show it. Run in-process (``cli.main``), as ``python -m pglock`` and through the
``pglock`` console script. The roles are dropped afterwards.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _pgdb import drop_roles, throwaway_database, with_params
from psycopg import sql

import pglock
from pglock import _lease, cli

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).with_name("pglock")

pytestmark = pytest.mark.timeout(120)


def monitoring_grants() -> list[str]:
    """The statements of docs/leases.md's sql block for ``monitor_role``."""
    section = (ROOT / "docs" / "leases.md").read_text().split("\n## Permissions\n", 1)[1]
    blocks = re.findall(r"```sql\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    (block,) = [b for b in blocks if "monitor_role" in b]
    return [s.strip() for s in block.split(";") if s.strip()]


@pytest.fixture(scope="module")
def db(pg_dsn: str) -> Iterator[str]:
    with throwaway_database(pg_dsn, prefix="pglock_cli_priv", install=True) as dsn:
        try:
            yield dsn
        finally:
            _lease.shutdown()


@pytest.fixture
def admin(db: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(db, autocommit=True, application_name="pglock-cli-priv-admin") as c:
        yield c


@pytest.fixture
def make_role(db: str, pg_dsn: str, app_name: str) -> Iterator[Callable[..., tuple[str, str]]]:
    """``make_role(*grants)``: a LOGIN role with these grants (``{role}`` in each), and its DSN."""
    made: list[str] = []

    def factory(*grants: str) -> tuple[str, str]:
        role = f"pglock_mon_{uuid.uuid4().hex[:8]}"
        made.append(role)
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
            for grant in grants:
                admin.execute(grant.format(role=role))
        return role, with_params(db, user=role, application_name=app_name)

    yield factory
    drop_roles(pg_dsn, made, owned_in=[db])


@pytest.fixture
def held(db: str, admin: psycopg.Connection[Any]) -> Iterator[dict[str, str]]:
    """An advisory lock, a lease and a semaphore permit, held by the owner."""
    names = {k: f"{k}:{uuid.uuid4().hex[:10]}" for k in ("lock", "lease", "sem")}
    with (
        pglock.pg_lock(admin, names["lock"]),
        pglock.lease(db, names["lease"], ttl=60, keepalive=False),
        pglock.semaphore(db, names["sem"], limit=3),
    ):
        yield names


def run_cli(*args: str, script: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [str(CONSOLE_SCRIPT)] if script else [sys.executable, "-m", "pglock"]
    env = {k: v for k, v in os.environ.items() if k != "PGLOCK_DSN"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False
    )


def status(dsn: str, *names: str, script: bool = False) -> tuple[str, dict[str, Any]]:
    """The text and the JSON document of ``pglock status`` (both exit 0, nothing on stderr)."""
    text = run_cli("status", "--dsn", dsn, *names, script=script)
    js = run_cli("status", "--dsn", dsn, "--json", *names, script=script)
    for proc in (text, js):
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    return text.stdout, json.loads(js.stdout)


def test_the_documented_monitoring_role_sees_every_section(
    make_role: Callable[..., tuple[str, str]], held: dict[str, str]
) -> None:
    grants = [re.sub(r"\bmonitor_role\b", "{role}", g) for g in monitoring_grants()]
    _, dsn = make_role(*grants)
    text, doc = status(dsn, *held.values(), script=True)
    assert doc["errors"] == {}
    (lock,) = doc["advisory_locks"]
    assert (lock["name"], lock["granted"]) == (held["lock"], True)
    assert lock["backend_start"] is not None  # pg_read_all_stats: another role's session
    assert [le["name"] for le in doc["leases"]] == [held["lease"]]
    assert [(s["name"], s["held"]) for s in doc["semaphores"]] == [(held["sem"], 1)]
    assert "not shown" not in text
    assert "Leases: 1 live" in text and "Semaphores: 1" in text


def test_a_monitoring_role_without_execute_on_leases_sees_the_rest(
    make_role: Callable[..., tuple[str, str]],
    held: dict[str, str],
    admin: psycopg.Connection[Any],
) -> None:
    role, dsn = make_role(
        "GRANT USAGE ON SCHEMA pglock TO {role}",
        "GRANT SELECT ON pglock.lock_names TO {role}",
        "GRANT SELECT ON pglock.semaphore, pglock.semaphore_permit TO {role}",
    )
    text, doc = status(dsn, *held.values())
    fix = f"GRANT EXECUTE ON FUNCTION pglock.leases(text) TO {role};"
    assert doc["errors"]["leases"] == {
        "error": "permission_denied",
        "message": f"role {role} may not call pglock.leases()",
        "fix": [fix],
    }
    assert doc["errors"]["sessions"]["fix"] == [f"GRANT pg_read_all_stats TO {role};"]
    assert set(doc["errors"]) == {"leases", "sessions"}
    assert doc["leases"] is None
    assert [lk["name"] for lk in doc["advisory_locks"]] == [held["lock"]]
    assert [s["name"] for s in doc["semaphores"]] == [held["sem"]]
    lines = text.splitlines()
    (i,) = [n for n, ln in enumerate(lines) if ln.startswith("Leases: not shown: ")]
    assert lines[i + 1] == "    " + fix
    assert any(ln.split()[:3] == [held["lock"], "exclusive", "held"] for ln in lines)
    assert "Semaphores: 1" in text

    admin.execute(fix)
    _, after = status(dsn, *held.values())
    assert set(after["errors"]) == {"sessions"}
    assert [le["name"] for le in after["leases"]] == [held["lease"]]


def test_a_role_without_any_grant_sees_the_advisory_locks(
    make_role: Callable[..., tuple[str, str]],
    held: dict[str, str],
    admin: psycopg.Connection[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    role, dsn = make_role()
    assert cli.main(["status", "--dsn", dsn, held["lock"]]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "Advisory locks: 1 held, 0 waiting" in out
    assert "permission denied" not in out
    assert cli.main(["status", "--dsn", dsn, "--json", *held.values()]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(lk["key"], lk["name"]) for lk in doc["advisory_locks"]] == [
        (pglock.key(held["lock"]), None)
    ]
    assert (doc["leases"], doc["semaphores"]) == (None, None)
    usage = f"GRANT USAGE ON SCHEMA pglock TO {role};"
    assert {k: (e["error"], e["fix"][0]) for k, e in doc["errors"].items()} == {
        "names": ("permission_denied", usage),
        "sessions": ("permission_denied", f"GRANT pg_read_all_stats TO {role};"),
        "leases": ("permission_denied", usage),
        "semaphores": ("permission_denied", usage),
    }
    for title in ("Lock names", "Sessions of other roles", "Leases", "Semaphores"):
        assert f"{title}: not shown: role {role} may not " in out

    for entry in doc["errors"].values():  # the printed fixes are exact and enough
        for stmt in entry["fix"]:
            admin.execute(stmt)
    _, after = status(dsn, *held.values())
    assert after["errors"] == {}
    assert [lk["name"] for lk in after["advisory_locks"]] == [held["lock"]]
    assert [le["name"] for le in after["leases"]] == [held["lease"]]


def test_a_missing_schema_is_not_installed_not_a_permission_problem(
    make_role: Callable[..., tuple[str, str]],
) -> None:
    _, dsn = make_role()
    text, doc = status(dsn, "--schema", "pglock_nowhere")
    assert doc["schema_installed"] is False
    assert {k: e["error"] for k, e in doc["errors"].items()} == {
        "leases": "not_installed",
        "semaphores": "not_installed",
    }
    assert doc["errors"]["leases"]["fix"] == ["pglock install --dsn DSN --schema pglock_nowhere"]
    assert "Leases: not shown: the pglock schema 'pglock_nowhere' is not installed" in text
    assert "GRANT" not in text


def test_semaphores_without_select_is_a_permission_error_not_a_missing_schema(
    make_role: Callable[..., tuple[str, str]],
) -> None:
    _, dsn = make_role("GRANT USAGE ON SCHEMA pglock TO {role}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            pglock.semaphores(conn)
        with pytest.raises(pglock.SchemaNotInstalled):
            pglock.semaphores(conn, schema="pglock_nowhere")


def test_a_role_name_with_control_characters_is_escaped_in_the_table_and_exact_in_json(
    db: str, pg_dsn: str, app_name: str, held: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The role's name goes into the "not shown" lines and their GRANTs: escaped in the table
    (no raw ESC, line break or bidi override), exact in --json, where the GRANT still runs."""
    role = f"pglock_mon_{uuid.uuid4().hex[:8]}\x1b[2J\n  forged\u202e"
    ident = sql.Identifier(role)
    with psycopg.connect(db, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    try:
        dsn = with_params(db, user=role, application_name=app_name)
        assert cli.main(["status", "--dsn", dsn, *held.values()]) == 0
        out = capsys.readouterr().out
        assert [c for c in out if not c.isprintable() and c != "\n"] == []
        quoted = '"' + role.encode("unicode_escape").decode() + '"'
        assert f"Leases: not shown: role {quoted} may not " in out
        assert f"    GRANT USAGE ON SCHEMA pglock TO {quoted};" in out.splitlines()
        assert cli.main(["status", "--dsn", dsn, "--json", *held.values()]) == 0
        doc = json.loads(capsys.readouterr().out)
        fix = doc["errors"]["leases"]["fix"][0]
        assert fix == f'GRANT USAGE ON SCHEMA pglock TO "{role}";'
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute(fix)  # the exact statement: it runs as --json prints it
            admin.execute(sql.SQL("DROP OWNED BY {}").format(ident))
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))
