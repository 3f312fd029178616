"""Test harness: one fixture finds a real Postgres server, and every test is checked for leaks.

Where the server comes from, in order:

1. ``--pg-dsn DSN`` or the ``PGLOCK_TEST_DSN`` environment variable;
2. a throwaway container from testcontainers, when a Docker engine answers;
3. an embedded server from the ``pgserver`` package (Postgres binaries shipped on PyPI),
   started in a temporary directory for the session.

If none works the database tests are skipped with the reason, except under CI (``CI`` set),
where they fail: CI must never pass without having talked to Postgres.

Every connection a test opens through :func:`connect` carries the test's own
``application_name`` (the ``app_name`` fixture, ``pglock-test:<random>``); after each test, any
advisory lock still held by a session with that name fails the test (a leak). Scoping by the
test's own name keeps tests that run at the same time against the same server apart.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import socket
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

APP = "pglock-test"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--pg-dsn", default=None, help="DSN of a Postgres server for the tests")


def _docker_answers() -> bool:
    """Does a Docker engine answer? Checked with a plain socket first: the docker client
    leaks its socket when the engine is absent (a ResourceWarning, an error under pytest)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://"):
        path = host[len("unix://") :]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(3)
                s.connect(path)
        except OSError:
            return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            import docker  # type: ignore[import-untyped]

            client = docker.from_env(timeout=3)
            try:
                client.ping()
            finally:
                client.close()
            return True
        except Exception:
            return False
        finally:
            gc.collect()  # let anything the client leaked warn here, where it is ignored


@contextlib.contextmanager
def _container() -> Iterator[str]:
    try:
        from testcontainers.postgres import PostgresContainer
    except ImportError:  # older testcontainers
        from testcontainers.community.postgres import (  # type: ignore[import-not-found,no-redef]
            PostgresContainer,
        )
    with PostgresContainer("postgres:16-alpine", driver=None) as pg:
        yield pg.get_connection_url()


@contextlib.contextmanager
def _embedded() -> Iterator[str]:
    import pgserver

    # The data directory, which also holds the server's Unix socket (the server listens on no
    # TCP port). initdb makes it mode 0700, owned (as root) by pgserver's own ``pgserver`` OS
    # user: only that user and root reach the socket, so tests that run a tool as another OS
    # user (pgbouncer) run it as the socket directory's owner.
    tmp = tempfile.mkdtemp(prefix="pglock-pg-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        server = pgserver.get_server(tmp, cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def _can_connect(dsn: str) -> str | None:
    try:
        with psycopg.connect(dsn, connect_timeout=5, autocommit=True) as c:
            c.execute("SELECT 1")
        return None
    except Exception as exc:
        return str(exc).strip()


@pytest.fixture(scope="session")
def pg_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """The DSN of a real Postgres server (see the module docstring for where it comes from)."""
    in_ci = bool(os.environ.get("CI"))
    reasons: list[str] = []
    dsn = request.config.getoption("--pg-dsn") or os.environ.get("PGLOCK_TEST_DSN")
    if dsn:
        problem = _can_connect(dsn)
        if problem is None:
            yield dsn
            return
        reasons.append(f"PGLOCK_TEST_DSN/--pg-dsn {dsn!r} does not answer: {problem}")
    with contextlib.ExitStack() as stack:
        found: str | None = None
        if not dsn and _docker_answers():
            try:
                found = stack.enter_context(_container())
            except Exception as exc:
                reasons.append(f"testcontainers failed: {exc}")
        if found is None and not dsn:
            try:
                found = stack.enter_context(_embedded())
            except Exception as exc:
                reasons.append(f"embedded pgserver failed: {exc!r}")
        if found is None:
            msg = "no Postgres server for the database tests: " + "; ".join(reasons)
            if in_ci:
                pytest.fail(msg, pytrace=False)
            pytest.skip(msg)
        yield found


def held_advisory(dsn: str, app_name: str) -> list[tuple[Any, ...]]:
    """Advisory locks held by sessions whose application_name is ``app_name``."""
    with psycopg.connect(dsn, autocommit=True, application_name="pglock-checker") as c:
        return c.execute(
            "SELECT a.pid, a.application_name, l.mode, "
            "       (l.classid::bigint << 32) | l.objid::bigint AS key "
            "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = %s",
            (app_name,),
        ).fetchall()


@pytest.fixture
def app_name() -> str:
    """This test's application_name: give it to every session the test opens."""
    return f"{APP}:{uuid.uuid4().hex[:12]}"


@pytest.fixture
def connect(pg_dsn: str, app_name: str) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    """Factory for test connections (autocommit by default); all are closed after the test."""
    opened: list[psycopg.Connection[Any]] = []

    def factory(autocommit: bool = True, **kwargs: Any) -> psycopg.Connection[Any]:
        kwargs.setdefault("application_name", app_name)
        c = psycopg.connect(pg_dsn, autocommit=autocommit, **kwargs)
        opened.append(c)
        return c

    yield factory
    # Look for leaks before closing: closing would make Postgres drop them silently.
    leaked = held_advisory(pg_dsn, app_name)
    for c in opened:
        with contextlib.suppress(Exception):
            c.close()
    if leaked:
        pytest.fail(f"test leaked advisory locks (pid, app, mode, key): {leaked}", pytrace=False)


@pytest.fixture(autouse=True)
def _fresh_name_registry() -> None:
    """Each test meets the name registry as a new process would: nothing sent or queued, the
    full rate (pglock._registry is process-wide state, and its rate is per second)."""
    from pglock import _registry

    _registry.clear()


@pytest.fixture(autouse=True)
def _no_leaked_locks(request: pytest.FixtureRequest, app_name: str) -> Iterator[None]:
    """Fail a database test that ends with an advisory lock still held by a test session
    that outlived the test (a pool or connection the test did not close)."""
    dsn = request.getfixturevalue("pg_dsn") if "pg_dsn" in request.fixturenames else None
    yield
    if dsn is None:
        return
    leaked = held_advisory(dsn, app_name)
    if leaked:
        pytest.fail(f"test leaked advisory locks (pid, app, mode, key): {leaked}", pytrace=False)


@pytest.fixture
def conn(connect: Callable[..., psycopg.Connection[Any]]) -> psycopg.Connection[Any]:
    """An autocommit psycopg connection."""
    return connect()


@pytest.fixture
def other(connect: Callable[..., psycopg.Connection[Any]]) -> psycopg.Connection[Any]:
    """A second session, to observe and contend."""
    return connect()


@pytest.fixture
def name() -> str:
    """A lock name unique to this test."""
    return f"test:{uuid.uuid4()}"


@pytest.fixture
def believer(pg_dsn: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The believer oracle (tests/_believer.py) for this test: every grant pglock reports is
    checked against the database at once; a disagreement fails the test at teardown. A module
    runs under it with ``pytestmark = pytest.mark.usefixtures("believer")``."""
    import _believer

    with _believer.believing(pg_dsn) as oracle:
        yield oracle
    _believer.SESSION.record(request.node.nodeid, oracle)
    verdict = oracle.verdict()
    if verdict:
        pytest.fail(verdict, pytrace=False)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What the believer oracle checked in this run, and the tests under it that saw no grant."""
    import sys

    believer = sys.modules.get("_believer")
    lines = [] if believer is None else believer.SESSION.summary()
    if lines:
        terminalreporter.write_sep("-", "believer oracle")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The lease and semaphore statements sent during the test, by kind (tests/_sent.py)."""
    import _sent

    return _sent.install(monkeypatch.setattr)
