"""CI packaging check: the built wheel ships every file pglock needs, installs into a clean
virtualenv, imports, answers ``pglock --version`` and installs its schema into a database.

Usage: ``python .ci/wheel_check.py DIST_DIR`` (run by .ci/run after ``python -m build``). The
database is a throwaway one next to ``PGLOCK_TEST_DSN``, or on an embedded server (pgserver)
when that is unset. Any failure exits non-zero.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import venv
import zipfile
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parents[1]


def shipped(wheel: str) -> None:
    """Every SQL file, revision module and py.typed of the source tree is in the wheel."""
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = [
        p.relative_to(ROOT).as_posix()
        for pattern in ("pglock/sql/*.sql", "pglock/migrations/versions/*.py", "pglock/py.typed")
        for p in sorted(ROOT.glob(pattern))
    ]
    missing = [w for w in wanted if w not in names]
    if len(wanted) < 10 or missing:
        sys.exit(f"the wheel lacks {missing} (looked for {len(wanted)} files)")
    print(f"the wheel ships {len(wanted)} SQL, revision and marker files")


def run(*cmd: str, cwd: str) -> str:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    return out.stdout.strip()


def plain_does_not_pull_the_binary(python: str, wheel: str, cwd: str) -> None:
    """``pip install pglock`` resolves psycopg without psycopg-binary (pglock[binary] adds it)."""
    report = os.path.join(cwd, "report.json")
    run(python, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
        report, wheel, cwd=cwd)
    with open(report) as f:
        names = {item["metadata"]["name"].lower() for item in json.load(f)["install"]}
    if "psycopg" not in names or "psycopg-binary" in names:
        sys.exit(f"pip install pglock would install {sorted(names)}")
    print(f"pip install pglock resolves {', '.join(sorted(names))}: no psycopg-binary")


def install_into_a_database(pglock_cli: str, dsn: str, cwd: str) -> None:
    db = f"pglock_wheel_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    try:
        target = make_conninfo(dsn, dbname=db)
        print(run(pglock_cli, "install", "--dsn", target, cwd=cwd))
        with psycopg.connect(target) as conn:
            revisions = [r[0] for r in conn.execute(
                "SELECT revision FROM pglock.schema_revision ORDER BY 1"
            ).fetchall()]
        expected = sorted(
            f"pglock_{Path(p).name[:4]}"
            for p in glob.glob(str(ROOT / "pglock/migrations/versions/0*.py"))
        )
        if revisions != expected:
            sys.exit(f"pglock install from the wheel left revisions {revisions}, not {expected}")
        print(f"pglock install from the wheel: revisions {', '.join(revisions)}")
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db))
            )


def main() -> None:
    (wheel,) = glob.glob(os.path.join(sys.argv[1], "pglock-*.whl"))
    shipped(wheel)
    work = tempfile.mkdtemp(prefix="pglock-wheel-")  # outside the source tree: no stray import
    try:
        env_dir = os.path.join(work, "venv")
        venv.create(env_dir, with_pip=True)
        bindir = os.path.join(env_dir, "bin")
        plain_does_not_pull_the_binary(os.path.join(bindir, "python"), wheel, work)
        run(os.path.join(bindir, "python"), "-m", "pip", "install", "-q", f"{wheel}[binary]",
            cwd=work)
        origin = run(os.path.join(bindir, "python"), "-c",
                     "import pglock; print(pglock.__version__, pglock.__file__)", cwd=work)
        if env_dir not in origin:
            sys.exit(f"pglock was imported from outside the wheel's venv: {origin}")
        version = run(os.path.join(bindir, "pglock"), "--version", cwd=work)
        print(f"installed wheel: {origin}; pglock --version: {version}")
        dsn = os.environ.get("PGLOCK_TEST_DSN")
        if dsn:
            install_into_a_database(os.path.join(bindir, "pglock"), dsn, work)
        else:
            import pgserver  # the CI venv has it (the test extra)

            server = pgserver.get_server(os.path.join(work, "pg"), cleanup_mode="stop")
            try:
                install_into_a_database(os.path.join(bindir, "pglock"), server.get_uri(), work)
            finally:
                server.cleanup()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
