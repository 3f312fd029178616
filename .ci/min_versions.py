"""CI: keep the lower bounds in pyproject.toml true.

Installs, into a fresh virtualenv on the oldest Python pglock supports (``python3.10`` when
found), every package at exactly the lowest version pyproject.toml admits: the runtime
dependencies, the extras a user installs beside pglock (every extra except the development
ones below) and the test tools. Then it runs the unit tests and a smoke subset of the
integration tests against the test server (``PGLOCK_TEST_DSN``).

The pins are read from pyproject.toml (``name>=X`` becomes ``name==X``), so raising or lowering
a bound there changes what this checks. A requirement without a ``>=`` lower bound fails the
run: a bound that is not there cannot be kept true.

The tests run in a database of their own, created on the ``PGLOCK_TEST_DSN`` server and dropped
afterwards, so this can run beside the main test run; without ``PGLOCK_TEST_DSN`` they run on a
throwaway cluster (tests/faults/cluster.py: Debian's or pgserver's binaries).

Usage: python .ci/min_versions.py   (from the repository root; about a minute and a half)
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10 runs this script too
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent

#: Extras for working on pglock itself, not installed beside it by users: their tools are
#: checked by the CI steps that use them, at the versions those steps install.
DEVELOPMENT = {"test", "lint", "docs", "bench", "cli", "embedded"}
#: Extras that only pick psycopg's implementation: the run uses pure-Python psycopg on the
#: system libpq, so that psycopg's own lower bound is what runs; these are only resolved.
IMPLEMENTATION = {"binary"}
#: Test tools, Django (docs/django.md promises 5.1+) and the OpenTelemetry SDK (the otel extra
#: pins opentelemetry-api to its lower bound; the SDK of the same version goes with it), pinned
#: to their lower bounds too; the rest of the test extra serves other tests (pgserver,
#: testcontainers, psycopg2).
TEST_TOOLS = {"pytest", "pytest-timeout", "hypothesis", "django", "opentelemetry-sdk"}

#: The smoke subset: each public entry point once, through each optional dependency, on the
#: oldest versions. Every database test here talks to the real server.
SMOKE = [
    "tests/unit",
    "tests/integration/test_advisory.py",
    "tests/integration/test_xact.py",
    "tests/integration/test_pool.py",
    "tests/integration/test_pool_sqlalchemy.py",
    "tests/integration/test_sqlalchemy_conn.py",
    "tests/integration/test_semaphore.py",
    "tests/integration/test_lease_keepalive.py",
    "tests/integration/test_django.py",
    "tests/integration/test_telemetry.py",
    "tests/migrations/test_migration_lock.py",
]

_BOUND = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([^,;\s]+)\s*(;.*)?$")


def pin(requirement: str) -> str:
    """``name[extra]>=X; marker`` -> ``name[extra]==X; marker``."""
    m = _BOUND.match(requirement)
    if m is None:
        raise SystemExit(f"min_versions: no single '>=' lower bound in {requirement!r}")
    name, extras, version, marker = m.groups()
    return f"{name}{extras or ''}=={version}{marker or ''}"


def requirements(*, implementation: bool = False) -> list[str]:
    """The pins to install, or with ``implementation`` those of the implementation extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    if implementation:
        return sorted({pin(r) for extra in IMPLEMENTATION for r in extras[extra]})
    reqs = list(project["dependencies"])
    for extra, deps in sorted(extras.items()):
        if extra not in DEVELOPMENT | IMPLEMENTATION:
            reqs += deps
    for dep in project["optional-dependencies"]["test"]:
        if re.split(r"[\[<>=;\s]", dep, maxsplit=1)[0] in TEST_TOOLS:
            reqs.append(dep)
    return sorted({pin(r) for r in reqs})


def oldest_python() -> str:
    """A Python 3.10 that runs (a pyenv shim may exist without the version selected)."""
    candidates = [shutil.which("python3.10")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    for candidate in candidates:
        if candidate and subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    print("min_versions: no Python 3.10 here; using", sys.executable)
    return sys.executable


@contextlib.contextmanager
def server() -> Iterator[str]:
    """A DSN of a database for this run alone."""
    import psycopg

    dsn = os.environ.get("PGLOCK_TEST_DSN")
    if not dsn:
        sys.path.insert(0, str(ROOT / "tests"))
        from faults.cluster import Cluster

        with Cluster(prefix="pglock-min-") as cluster:
            yield cluster.dsn()
        return
    db = f"pglock_min_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {db}")
    try:
        yield psycopg.conninfo.make_conninfo(dsn, dbname=db)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


def main() -> int:
    python = oldest_python()
    pins = requirements()
    print("min_versions: pinned", " ".join(pins))
    venv = Path(tempfile.mkdtemp(prefix="pglock-min-"))
    try:
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        vpy = str(venv / "bin" / "python")
        pip = [vpy, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, *pins], check=True)
        subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
        subprocess.run([*pip, "--dry-run", *requirements(implementation=True)], check=True)
        # The pins must also satisfy what each installed package asks of the others.
        subprocess.run([vpy, "-m", "pip", "check"], check=True)
        listed = subprocess.run(
            [vpy, "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True,
            text=True,
        ).stdout
        print("min_versions: installed", " ".join(sorted(listed.split())))
        with server() as dsn:
            env = dict(os.environ, PYTHONPATH=str(ROOT), PSYCOPG_IMPL="python",
                       PGLOCK_TEST_DSN=dsn)
            return subprocess.run(
                # psycopg2 (there only to test that other drivers are refused) is not installed.
                [vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                 "not psycopg2 and not another_driver", *SMOKE], cwd=ROOT, env=env,
            ).returncode
    finally:
        shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
