"""``pglock.alembic.migration_lock``: concurrent ``alembic upgrade head`` runs serialize.

The throwaway Alembic project in ``lock_project/`` runs the ``env.py`` snippet of
docs/alembic.md verbatim. Its revisions record every application in an ``applied`` table;
0002 sleeps 1 s and runs ``CREATE INDEX CONCURRENTLY`` in an ``autocommit_block()``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from _pgdb import sa_url, throwaway_database, with_params
from _truth import holder_pids as holders
from psycopg import sql

import pglock
from pglock.alembic import migration_lock

PROJECT = Path(__file__).resolve().parent / "lock_project"
Connect = Callable[..., psycopg.Connection[Any]]


def empty_database(pg_dsn: str) -> contextlib.AbstractContextManager[str]:
    """A new, empty database next to the test one; its libpq DSN. Dropped afterwards."""
    return throwaway_database(pg_dsn, prefix="pglock_mig")


def write_ini(tmp_path: Path, dsn: str) -> Path:
    url = sa_url(dsn).render_as_string(hide_password=False).replace("%", "%%")
    ini = tmp_path / "alembic.ini"
    ini.write_text(
        "[alembic]\n"
        f"script_location = {PROJECT}\n"
        f"sqlalchemy.url = {url}\n\n"
        "[loggers]\nkeys = root,pglock\n\n"
        "[handlers]\nkeys = stderr\n\n"
        "[formatters]\nkeys = plain\n\n"
        "[logger_root]\nlevel = WARNING\nhandlers = stderr\n\n"
        "[logger_pglock]\nlevel = INFO\nhandlers =\nqualname = pglock\n\n"
        "[handler_stderr]\nclass = StreamHandler\nargs = (sys.stderr,)\nformatter = plain\n\n"
        "[formatter_plain]\nformat = %(name)s %(levelname)s %(message)s\n"
    )
    return ini


def upgrade_concurrently(
    ini: Path, app_name: str, n: int, *, lock: bool
) -> list[subprocess.CompletedProcess[str]]:
    """Start ``n`` ``alembic upgrade head`` processes at once; wait for all (bounded)."""
    barrier = ini.parent / f"barrier-{uuid.uuid4().hex[:8]}"
    barrier.mkdir()
    env = {**os.environ, "PGAPPNAME": app_name, "PGLOCK_TEST_BARRIER": f"{barrier}:{n}"}
    env.pop("PGLOCK_TEST_NO_MIGRATION_LOCK", None)
    if not lock:
        env["PGLOCK_TEST_NO_MIGRATION_LOCK"] = "1"
    cmd = [sys.executable, "-m", "alembic", "-c", str(ini), "upgrade", "head"]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            results.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return results


def applied(dsn: str) -> list[tuple[str, int]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        if c.execute("SELECT to_regclass('applied')").fetchone() == (None,):
            return []
        rows = c.execute(
            "SELECT revision, count(*)::int FROM applied GROUP BY 1 ORDER BY 1"
        ).fetchall()
        return [(r, n) for r, n in rows]


# --- acceptance ------------------------------------------------------------------------------


def test_four_concurrent_upgrades_all_succeed_and_apply_each_revision_once(
    pg_dsn: str, app_name: str, tmp_path: Path
) -> None:
    with empty_database(pg_dsn) as dsn:
        ini = write_ini(tmp_path, dsn)
        results = upgrade_concurrently(ini, app_name, 4, lock=True)
        for r in results:
            assert r.returncode == 0, r.stderr[-3000:]
        assert applied(dsn) == [
            ("0001", 1),
            ("0002", 1),
            ("0002-after-concurrently", 1),
            ("0003", 1),
        ]
        with psycopg.connect(dsn, autocommit=True) as c:
            assert c.execute("SELECT version_num FROM alembic_version").fetchall() == [("0003",)]
            assert c.execute("SELECT count(*) FROM item").fetchone() == (10,)
            valid = c.execute(
                "SELECT indisvalid FROM pg_index WHERE indexrelid = 'item_v_idx'::regclass"
            ).fetchone()
            assert valid == (True,)
        # the others really waited, then found nothing to do
        waited = sum("waiting for migration lock" in r.stderr for r in results)
        assert waited >= 1, [r.stderr[-500:] for r in results]


def test_negative_control_concurrent_upgrades_without_the_lock_collide(
    pg_dsn: str, app_name: str, tmp_path: Path
) -> None:
    with empty_database(pg_dsn) as dsn:
        ini = write_ini(tmp_path, dsn)
        results = upgrade_concurrently(ini, app_name, 2, lock=False)
        failed = [r for r in results if r.returncode != 0]
        twice = [rev for rev, n in applied(dsn) if n > 1]
        assert failed or twice, "without the lock nothing collided: the test proves nothing"
        for r in failed:  # they failed by colliding, not for some unrelated reason
            assert "already exists" in r.stderr or "duplicate key" in r.stderr, r.stderr[-2000:]


# --- the waiting side does not stall CREATE INDEX CONCURRENTLY ------------------------------------


def _wait_for(predicate: Callable[[], bool], what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _cic_waits_on(observer: psycopg.Connection[Any], cic_pid: int, pid: int) -> bool:
    """True when backend ``cic_pid`` waits for a virtualxid lock that ``pid`` holds."""
    row = observer.execute(
        "SELECT count(*) FROM pg_locks w JOIN pg_locks h ON h.locktype = 'virtualxid' "
        "AND h.virtualxid = w.virtualxid AND h.granted "
        "WHERE w.locktype = 'virtualxid' AND NOT w.granted AND w.pid = %s AND h.pid = %s",
        (cic_pid, pid),
    ).fetchone()
    return bool(row and row[0])


def test_blocking_waiter_stalls_create_index_concurrently_a_polling_one_does_not(
    pg_dsn: str, app_name: str, connect: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    """Why migration_lock polls: a session blocked in pg_advisory_lock() holds a snapshot that
    CREATE INDEX CONCURRENTLY waits for (control), a polling migration_lock waiter does not."""
    table = f"t_{uuid.uuid4().hex[:12]}"
    other.execute(sql.SQL("CREATE TABLE {} (v int)").format(sql.Identifier(table)))
    holder = connect()
    cic = connect()
    cic_pid = cic.info.backend_pid
    create = sql.SQL("CREATE INDEX CONCURRENTLY {} ON {} (v)")
    try:
        with pglock.pg_lock(holder, name):
            # Control: a blocking waiter; CIC ends up waiting for it.
            blocker = connect()
            blocker_pid = blocker.info.backend_pid
            errors: list[BaseException] = []

            def block() -> None:
                try:
                    blocker.execute("SET lock_timeout = '20s'")
                    blocker.execute("SELECT pg_advisory_lock(%s)", (pglock.key(name),))
                    blocker.execute("SELECT pg_advisory_unlock(%s)", (pglock.key(name),))
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=block)
            t.start()
            _wait_for(
                lambda: other.execute(
                    "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted",
                    (blocker_pid,),
                ).fetchone()
                == (1,),
                "the blocking waiter",
            )
            done = threading.Event()

            def run_cic(index: str) -> None:
                try:
                    cic.execute("SET statement_timeout = '30s'")
                    cic.execute(create.format(sql.Identifier(index), sql.Identifier(table)))
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    done.set()

            c1 = threading.Thread(target=run_cic, args=(f"{table}_a",))
            c1.start()
            _wait_for(lambda: _cic_waits_on(other, cic_pid, blocker_pid), "CIC to wait")
            other.execute("SELECT pg_cancel_backend(%s)", (blocker_pid,))  # end the control
            t.join(timeout=20)
            c1.join(timeout=30)
            assert done.is_set()
            assert len(errors) == 1 and isinstance(errors[0], psycopg.errors.QueryCanceled)

            # migration_lock's waiter polls: CIC completes while it is still waiting.
            waiting = threading.Event()
            acquired = threading.Event()
            failures: list[BaseException] = []

            def wait_for_migration_lock() -> None:
                try:
                    waiting.set()
                    with migration_lock(
                        with_params(pg_dsn, application_name=app_name),
                        name=name,
                        timeout=30,
                    ):
                        acquired.set()
                except BaseException as exc:
                    failures.append(exc)

            w = threading.Thread(target=wait_for_migration_lock)
            w.start()
            assert waiting.wait(10)
            done.clear()
            run_cic(f"{table}_b")  # returns once the index is built
            assert done.is_set() and len(errors) == 1, errors
            assert not acquired.is_set()  # the waiter was waiting all along
        w.join(timeout=30)
        assert acquired.is_set() and not failures, failures
    finally:
        other.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))


# --- the API ---------------------------------------------------------------------------------


@pytest.fixture
def app_dsn(pg_dsn: str, app_name: str) -> str:
    return with_params(pg_dsn, application_name=app_name)


@pytest.mark.parametrize("form", ["libpq", "url", "sa_url", "engine", "connection", "psycopg2"])
def test_accepted_sources(
    form: str, app_dsn: str, other: psycopg.Connection[Any], name: str
) -> None:
    url = sa_url(app_dsn)  # application_name in its query string
    engine = None
    source: Any
    if form == "libpq":
        source = app_dsn
    elif form == "url":
        source = url.render_as_string(hide_password=False)
    elif form == "sa_url":
        source = url
    else:
        driver = "postgresql+psycopg2" if form == "psycopg2" else "postgresql+psycopg"
        engine = sa.create_engine(url.set(drivername=driver))
        source = engine
    try:
        if form == "connection":
            assert engine is not None
            with engine.connect() as migration_conn, migration_lock(
                migration_conn, name=name, timeout=5
            ):
                mine = holders(other, name)
                assert len(mine) == 1
                # a dedicated connection, not the migration connection
                pid = migration_conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
                assert mine != [pid]
        else:
            with migration_lock(source, name=name, timeout=5):
                assert len(holders(other, name)) == 1
        assert holders(other, name) == []
    finally:
        if engine is not None:
            engine.dispose()


def test_timeout_when_another_process_migrates(
    app_dsn: str, other: psycopg.Connection[Any], name: str
) -> None:
    with pglock.pg_lock(other, name):
        with pytest.raises(pglock.LockNotAcquired) as info, migration_lock(
            app_dsn, name=name, timeout=0.3
        ):
            pytest.fail("migrated without the lock")
        assert info.value.name == name
        with pytest.raises(pglock.LockNotAcquired), migration_lock(app_dsn, name=name, timeout=0):
            pytest.fail("migrated without the lock")
    assert holders(other, name) == []


def test_body_error_releases_and_propagates(
    app_dsn: str, other: psycopg.Connection[Any], name: str
) -> None:
    with pytest.raises(RuntimeError, match="revision failed"), migration_lock(app_dsn, name=name):
        assert len(holders(other, name)) == 1
        raise RuntimeError("revision failed")
    assert holders(other, name) == []


def test_lost_lock_connection_raises_lock_lost(
    app_dsn: str, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    with pytest.raises(pglock.LockLost), migration_lock(app_dsn, name=name):
        (pid,) = holders(other, name)
        other.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))


@pytest.mark.parametrize(
    ("source", "kwargs", "error"),
    [
        (42, {}, TypeError),
        (None, {}, TypeError),
        ("", {}, ValueError),
        ("sqlite:///x.db", {}, TypeError),
        ("postgresql://localhost/x", {"name": ""}, ValueError),
        ("postgresql://localhost/x", {"name": 5}, TypeError),
        ("postgresql://localhost/x", {"timeout": -1}, ValueError),
        ("postgresql://localhost/x", {"timeout": "1"}, TypeError),
    ],
)
def test_bad_arguments_before_connecting(source: Any, kwargs: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        migration_lock(source, **kwargs)


def test_sqlite_engine_refused() -> None:
    engine = sa.create_engine("sqlite://")
    with pytest.raises(TypeError, match="PostgreSQL"):
        migration_lock(engine)
