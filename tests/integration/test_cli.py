"""The ``pglock`` command, run as a separate process: status (text, --json, --watch), demo,
--version, and the documented exit codes (0 ok, 1 failed, 2 usage, 130 interrupted)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _pgdb import dbname_of, throwaway_database, with_db

import pglock
from pglock import cli

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "PGLOCK_DSN"}
    full_env["PYTHONPATH"] = str(ROOT)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pglock", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=full_env,
        cwd=ROOT,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(err.splitlines()) == 1, proc.stderr
    assert err.startswith("pglock: error: "), err
    return err


@pytest.fixture(scope="module")
def dsn(pg_dsn: str) -> Iterator[str]:
    with throwaway_database(pg_dsn, prefix="pglock_cli", install=True) as d:
        yield d


@pytest.fixture
def open_(app_name: str) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    opened: list[psycopg.Connection[Any]] = []

    def factory(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
        kwargs.setdefault("application_name", app_name)
        c = psycopg.connect(dsn, autocommit=True, **kwargs)
        opened.append(c)
        return c

    yield factory
    for c in opened:
        c.close()


def uniq(prefix: str = "cli") -> str:
    return f"{prefix}:{uuid.uuid4().hex[:12]}"


# --- status ---------------------------------------------------------------------------------


def test_status_shows_a_lock_held_by_this_process_by_name_holder_and_age(
    dsn: str, open_: Callable[..., psycopg.Connection[Any]], app_name: str
) -> None:
    name = uniq("report")
    holder = open_(dsn)
    with pglock.pg_lock(holder, name):
        proc = run_cli("status", "--dsn", dsn)
        activity = open_(dsn).execute(
            "SELECT state_change FROM pg_stat_activity WHERE pid = %s",
            (holder.info.backend_pid,),
        ).fetchone()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    (line,) = [ln for ln in proc.stdout.splitlines() if name in ln]
    cells = line.split()
    assert cells[:3] == [name, "exclusive", "held"], line
    assert cells[3] == str(holder.info.backend_pid)
    assert cells[4] == app_name
    # How long: a duration, measured on the server from the end of the holder's lock
    # statement (its state_change), not a bound.
    assert re.fullmatch(r"\d+ms|\d+\.\ds|\d+m\d\ds", cells[-1]), line
    assert activity is not None and activity[0] is not None
    assert "Advisory locks: 1 held, 0 waiting" in proc.stdout


def test_status_json_holder_and_waiter(
    dsn: str, open_: Callable[..., psycopg.Connection[Any]], app_name: str
) -> None:
    name = uniq("report")
    holder = open_(dsn, application_name=f"{app_name}/holder")
    waiter = open_(dsn, application_name=f"{app_name}/waiter")
    observer = open_(dsn)
    lock = pglock.pg_lock(holder, name)
    assert lock.acquire()
    got = threading.Event()

    def wait() -> None:
        with pglock.pg_lock(waiter, name, timeout=30):
            got.set()

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    # Until the waiter is queued, and (PostgreSQL 14+) its waitstart is set: Postgres fills it
    # in a moment after the wait begins.
    while not (
        len(locks := pglock.advisory_locks(observer, name)) == 2
        and (locks[1].waiting_since is not None or observer.info.server_version < 140000)
    ):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    state_change = observer.execute(
        "SELECT state_change FROM pg_stat_activity WHERE pid = %s", (holder.info.backend_pid,)
    ).fetchone()
    try:
        proc = run_cli("status", "--dsn", dsn, "--json", name)
    finally:
        lock.release()
        assert got.wait(10)
        t.join(5)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema_installed"] is True
    held, waiting = doc["advisory_locks"]
    assert held["name"] == waiting["name"] == name
    assert held["key"] == pglock.key(name)
    assert (held["granted"], waiting["granted"]) == (True, False)
    assert held["pid"] == holder.info.backend_pid
    assert held["application_name"] == f"{app_name}/holder"
    assert waiting["application_name"] == f"{app_name}/waiter"
    assert held["mode"] == "exclusive"
    assert held["held_since_basis"] == "statement"
    assert state_change is not None
    assert datetime.fromisoformat(held["held_since"]) == state_change[0]
    observed = datetime.fromisoformat(held["observed_at"])
    assert held["held_for"] == pytest.approx((observed - state_change[0]).total_seconds())
    assert waiting["blocked_by"] == [holder.info.backend_pid]
    assert waiting["held_for"] is None
    if observer.info.server_version >= 140000:
        assert waiting["waiting_for"] is not None and waiting["waiting_for"] >= 0


def test_status_json_leases_and_semaphores(
    dsn: str, open_: Callable[..., psycopg.Connection[Any]]
) -> None:
    lease_name, sem_name = uniq("job"), uniq("exports")
    with pglock.lease(dsn, lease_name, ttl=60, metadata={"by": "api-1"}, keepalive=False) as le:
        sem = pglock.semaphore(dsn, sem_name, limit=3)
        with sem.hold(permits=2):
            proc = run_cli("status", "--dsn", dsn, "--json", lease_name, sem_name)
            text = run_cli("status", "--dsn", dsn, lease_name, sem_name)
        token = le.token
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    (lease,) = doc["leases"]
    assert lease["name"] == lease_name
    assert lease["token"] == token
    assert lease["metadata"] == {"by": "api-1"}
    assert 0 < lease["expires_in"] <= 60
    (sem_doc,) = doc["semaphores"]
    assert (sem_doc["name"], sem_doc["limit"], sem_doc["held"]) == (sem_name, 3, 2)
    (h,) = sem_doc["holders"]
    assert h["permits"] == 2 and 0 < h["expires_in"] <= 60
    assert text.returncode == 0
    assert lease_name in text.stdout and "2/3" in text.stdout


def test_status_without_the_schema(pg_dsn: str) -> None:
    with throwaway_database(pg_dsn, prefix="pglock_cli_bare", install=False) as bare:
        proc = run_cli("status", "--dsn", bare)
        js = run_cli("status", "--dsn", bare, "--json")
    assert proc.returncode == 0, proc.stderr
    assert "not installed" in proc.stdout
    assert json.loads(js.stdout)["schema_installed"] is False


def test_status_reads_pglock_dsn_from_the_environment(dsn: str) -> None:
    proc = run_cli("status", "--json", env={"PGLOCK_DSN": dsn})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["database"] == psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]


def test_status_watch_refreshes_until_ctrl_c(dsn: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pglock", "status", "--dsn", dsn, "--json", "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        second = json.loads(proc.stdout.readline())
        assert second["server_time"] > first["server_time"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


#: Characters no cell may print raw: ANSI sequences (a clear screen, a window title ended by
#: BEL, a colour), line breaks that would start a forged row, C1 controls, DEL, bidi overrides.
HOSTILE = "\x1b[2J\x1b]0;pwned\x07\r\n  forged  exclusive  held\t\x85\x7f\u202eevil\x1b[31m\\"


def visible(text: str) -> str:
    """What the table must show for ``text`` (printable ASCII plus HOSTILE's characters)."""
    return text.encode("unicode_escape").decode()


def raw_controls(text: str) -> list[str]:
    return [c for c in text if not c.isprintable() and c != "\n"]


def test_status_escapes_what_the_database_and_other_roles_wrote(
    dsn: str, open_: Callable[..., psycopg.Connection[Any]], app_name: str
) -> None:
    """Lock names (the name registry), lease names, holder ids and metadata, semaphore names,
    a session's application_name and latest query: whoever wrote them, the table and a --watch
    frame show every control, format and bidi character (and backslash) as an escape, one row
    per lock, columns aligned; --json gives the exact strings."""
    lock_name, lease_name, sem_name = (f"{p}-{uuid.uuid4().hex[:8]}{HOSTILE}" for p in "lqs")
    lease_holder, metadata = f"h{HOSTILE}", {f"k{HOSTILE}": f"v{HOSTILE}"}
    holder = open_(dsn, application_name=f"{app_name}{HOSTILE}")
    observer = open_(dsn)
    names = (lock_name, lease_name, sem_name)
    with pglock.pg_lock(holder, lock_name), pglock.lease(
        dsn, lease_name, ttl=60, holder=lease_holder, metadata=metadata, keepalive=False
    ) as le, pglock.semaphore(dsn, sem_name, 2, metadata=metadata):
        holder.execute(f"SELECT 1 /* {HOSTILE} */")  # the session's latest query
        (app,) = observer.execute(  # Postgres itself cleans application_name (15: '?')
            "SELECT application_name FROM pg_stat_activity WHERE pid = %s",
            (holder.info.backend_pid,),
        ).fetchone() or (None,)
        table = run_cli("status", "--dsn", dsn, "-v", *names)
        js = run_cli("status", "--dsn", dsn, "--json", *names)
        watch = subprocess.Popen(
            [sys.executable, "-m", "pglock", "status", "--dsn", dsn, "--watch", "0.2", *names],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
        )
        try:
            assert watch.stdout is not None
            frame = [watch.stdout.readline()]  # the first frame: up to the next one's header
            while not (line := watch.stdout.readline()).startswith("pglock status:"):
                frame.append(line)
                assert len(frame) < 100
            watch.send_signal(signal.SIGINT)
            rest, _ = watch.communicate(timeout=TIMEOUT)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait(TIMEOUT)
        token = le.token
    assert table.returncode == js.returncode == watch.returncode == 0, table.stderr + js.stderr
    assert raw_controls(line + rest) == []  # the frames after the first one
    for out in (table.stdout, "".join(frame)):
        assert raw_controls(out) == []
        lines = out.splitlines()
        (lock_row,) = [ln for ln in lines if ln.startswith("  " + visible(lock_name)[:45])]
        mode_at = next(ln for ln in lines if ln.startswith("  LOCK")).index("MODE")
        cells = lock_row[mode_at:].split()[:3]  # columns aligned
        assert cells == ["exclusive", "held", str(holder.info.backend_pid)], lock_row
        assert visible(app or "")[:25] in lock_row
        header = next(ln for ln in lines if ln.startswith("  NAME") and "TOKEN" in ln)
        (lease_row,) = [ln for ln in lines if ln.startswith("  " + visible(lease_name)[:45])]
        assert lease_row[header.index("TOKEN"):].split()[0] == str(token)  # columns aligned
        assert visible(lease_holder)[:29] in lease_row
        assert lease_row.endswith(json.dumps(metadata)[:37] + "...")  # JSON's escapes, once
        assert [ln for ln in lines if ln.startswith("  " + visible(sem_name)[:45])]
    (query,) = [ln for ln in table.stdout.splitlines() if "query: SELECT 1" in ln]
    assert "\\x1b]0;pwned\\x07" in query and "\\u202eevil" in query
    doc = json.loads(js.stdout)
    (lock,) = doc["advisory_locks"]
    assert (lock["name"], lock["application_name"]) == (lock_name, app)
    assert lock["query"] == f"SELECT 1 /* {HOSTILE} */"
    (lease,) = doc["leases"]
    assert (lease["name"], lease["holder"], lease["metadata"]) == (lease_name, lease_holder,
                                                                   metadata)
    (sem,) = doc["semaphores"]
    assert sem["name"] == sem_name and [h["metadata"] for h in sem["holders"]] == [metadata]


# --- exit codes -------------------------------------------------------------------------------


def test_unreachable_server_is_exit_1_with_one_line(dsn: str) -> None:
    with socket_bound_then_closed() as port:
        proc = run_cli("status", "--dsn", f"postgresql://postgres@127.0.0.1:{port}/x")
    assert proc.returncode == cli.EXIT_FAILED == 1
    err = assert_one_line_error(proc)
    assert "127.0.0.1" in err


def test_malformed_dsn_and_missing_database_are_exit_1(dsn: str) -> None:
    for bad in ("this is not a dsn", with_db(dsn, "no_such_db_" + dbname_of(dsn))):
        proc = run_cli("status", "--dsn", bad)
        assert proc.returncode == 1, (bad, proc.stderr)
        assert_one_line_error(proc)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("status",), id="no-dsn"),
        pytest.param(("status", "--dsn", "x", "--bogus"), id="unknown-option"),
        pytest.param(("status", "--dsn", "x", ""), id="empty-name"),
        pytest.param(("status", "--dsn", "x", "--watch", "0"), id="watch-zero"),
        pytest.param(("status", "--dsn", "x", "--watch", "soon"), id="watch-not-a-number"),
        pytest.param(("status", "--dsn", "x", "--schema", "Bad-Name"), id="bad-schema"),
        pytest.param(("demo", "--workers", "0"), id="demo-no-workers"),
        pytest.param(("demo", "--jobs", "many"), id="demo-jobs-not-a-number"),
        pytest.param(("frobnicate",), id="unknown-command"),
        pytest.param((), id="no-command"),
    ],
)
def test_usage_errors_are_exit_2(args: tuple[str, ...]) -> None:
    proc = run_cli(*args)
    assert proc.returncode == cli.EXIT_USAGE == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    if args:  # with no command at all, the help goes to stderr
        assert_one_line_error(proc)


def test_version_and_help_document_the_exit_codes() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"pglock {pglock.__version__} (Python ")
    for args in (("--help",), ("status", "--help"), ("demo", "--help")):
        out = run_cli(*args)
        assert out.returncode == 0
        assert "exit codes:" in out.stdout
        for code in ("0 ", "1 ", "2 ", "130"):
            assert f"\n  {code}" in out.stdout, (args, code)


def test_console_script_points_at_main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pyproject's console script is ``pglock.cli:main``, which returns the exit code."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^pglock\s*=\s*"pglock\.cli:main"\s*$', pyproject, re.MULTILINE)
    monkeypatch.delenv("PGLOCK_DSN", raising=False)
    assert cli.main(["status"]) == 2
    assert capsys.readouterr().err.startswith("pglock: error: no database given")


def test_demo_runs_against_a_given_server(dsn: str) -> None:
    proc = run_cli("demo", "--dsn", dsn, "--workers", "2", "--jobs", "20")
    assert proc.returncode == 0, proc.stderr
    assert "duplicates: 0" in proc.stdout
    assert "Summary" in proc.stdout


# --- helpers ----------------------------------------------------------------------------------


class socket_bound_then_closed:
    """A loopback port that nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        s.close()
        return port

    def __exit__(self, *exc: object) -> None:
        return None
