"""PgBouncer in session, transaction and statement pooling modes (T25, issue 14): which lock
works where, the ``pooler=`` override and the sharing checks.

The module starts its own PgBouncer (Debian's ``pgbouncer``; installed with apt-get when it is
missing, and the tests are skipped, saying why, only if that fails, except under CI, where they
fail), one instance per pooling mode (module-scoped), each on a free loopback port, in front of
the test server, with a throwaway config (``auth_type = trust``). As root it runs as another OS
user, as PgBouncer refuses to run as root: the owner of the server's socket directory when the
server listens on a Unix socket (the embedded server's data directory, mode 0700, holds its
socket), else ``postgres``.

Pooled databases: ``<db>`` (two server connections in transaction mode, ten in the others),
``<db>_one`` with a single one, where every client of transaction or statement pooling shares
the same server session (the raw-failure companion test uses it to show what pglock protects
against, the sharing tests to show pglock noticing), and ``<db>_two`` (two server connections)
for the test that moves a client to another server session. Each test that leaves pglock's mark
on a server session (``pooler="session"`` through transaction pooling) has a database of its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import psycopg
import psycopg_pool
import pytest
from _counter import run_counter
from _truth import holder_pids as holders
from _wire import RecordingConnection
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pglock
from pglock import _conn
from pglock.alembic import migration_lock

Connect = Callable[..., psycopg.Connection[Any]]


def _install_pgbouncer() -> str | None:
    """Install Debian's pgbouncer; return None when it is there, else why it is not."""
    if shutil.which("pgbouncer") or os.path.exists("/usr/sbin/pgbouncer"):
        return None
    if not shutil.which("apt-get"):
        return "pgbouncer is not installed and apt-get is not available"
    if os.geteuid() != 0:
        return "pgbouncer is not installed and installing it needs root (apt-get install pgbouncer)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    out = ""
    for cmds in (
        [["apt-get", "install", "-y", "-q", "pgbouncer"]],
        [["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "pgbouncer"]],
    ):
        try:
            for cmd in cmds:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
                out = (proc.stdout + proc.stderr)[-500:]
                if proc.returncode:
                    break
        except (OSError, subprocess.TimeoutExpired) as exc:
            out = repr(exc)
        if os.path.exists("/usr/sbin/pgbouncer"):
            return None
    return f"pgbouncer could not be installed with apt-get: {out.strip()}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Bouncer:
    port: int
    server: dict[str, Any]  # the real server's conninfo parameters
    #: A throwaway database with the pglock schema, pooled too (None before leases exist).
    lease_db: str | None = None
    mode: str = "transaction"

    def dsn(self, dbname: str | None = None) -> str:
        params = {k: v for k, v in self.server.items() if k in ("user", "password")}
        return make_conninfo(
            host="127.0.0.1", port=str(self.port), dbname=dbname or self.server["dbname"], **params
        )


def _need_pgbouncer() -> None:
    problem = _install_pgbouncer()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the PgBouncer tests: {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="module")
def lease_db(pg_dsn: str) -> Iterator[str | None]:
    """A throwaway database with the pglock schema, pooled by every PgBouncer of the module."""
    _need_pgbouncer()
    with contextlib.ExitStack() as stack:
        lease_db = None
        if importlib.util.find_spec("pglock._lease") is not None:
            from _pgdb import throwaway_database

            from pglock import _schema

            lease_dsn = stack.enter_context(
                throwaway_database(pg_dsn, prefix="pglock_bouncer", install=False)
            )
            _schema.install(lease_dsn)
            lease_db = conninfo_to_dict(lease_dsn)["dbname"]
        yield lease_db


@pytest.fixture(scope="module")
def bouncer(pg_dsn: str, lease_db: str | None) -> Iterator[Bouncer]:
    """PgBouncer in transaction pooling mode."""
    yield from _run_bouncer(pg_dsn, lease_db)


@pytest.fixture(scope="module")
def session_bouncer(pg_dsn: str, lease_db: str | None) -> Iterator[Bouncer]:
    """PgBouncer in session pooling mode."""
    yield from _run_bouncer(pg_dsn, lease_db, "session")


@pytest.fixture(scope="module")
def statement_bouncer(pg_dsn: str, lease_db: str | None) -> Iterator[Bouncer]:
    """PgBouncer in statement pooling mode."""
    yield from _run_bouncer(pg_dsn, lease_db, "statement")


def _run_bouncer(pg_dsn: str, lease_db: str | None, mode: str = "transaction") -> Iterator[Bouncer]:
    exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    server = conninfo_to_dict(pg_dsn)
    server.setdefault("user", os.environ.get("PGUSER", "postgres"))
    server.setdefault("dbname", server["user"])
    host = server.get("host", "127.0.0.1")
    port = server.get("port", "5432")
    db = server["dbname"]
    run_as: list[str] = []
    if os.geteuid() == 0:
        user = "postgres"
        if str(host).startswith("/"):  # a socket directory: only its owner may be able to enter
            user = pwd.getpwuid(os.stat(host).st_uid).pw_name
        try:
            pwd.getpwnam(user)
        except KeyError:
            pytest.skip(f"running as root and there is no {user!r} OS user to run pgbouncer as")
        if user == "root":
            pytest.skip("running as root and the server's socket directory belongs to root")
        run_as = ["runuser", "-u", user, "--"]
    tmp = tempfile.mkdtemp(prefix="pglock-pgbouncer-")
    listen = _free_port()
    target = f"host={host} port={port} dbname={db}"
    with open(os.path.join(tmp, "users.txt"), "w") as f:
        f.write(f'"{server["user"]}" "{server.get("password", "")}"\n')
    with open(os.path.join(tmp, "pgbouncer.ini"), "w") as f:
        f.write(
            f"[databases]\n{db} = {target}\n{db}_one = {target} pool_size=1\n"
            f"{db}_two = {target} pool_size=2\n"
            + (f"{lease_db} = host={host} port={port} dbname={lease_db}\n" if lease_db else "")
            + "\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {tmp}/users.txt\n"
            f"pool_mode = {mode}\ndefault_pool_size = {2 if mode == 'transaction' else 10}\n"
            "max_client_conn = 200\n"
            f"logfile = {tmp}/pgbouncer.log\n"
        )
    if run_as:
        shutil.chown(tmp, run_as[2])
        for name in os.listdir(tmp):
            shutil.chown(os.path.join(tmp, name), run_as[2])
    proc = subprocess.Popen(
        [*run_as, exe, os.path.join(tmp, "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    b = Bouncer(listen, server, lease_db, mode)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with psycopg.connect(
                    b.dsn(), connect_timeout=2, prepare_threshold=None, autocommit=True
                ) as c:
                    c.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = ""
                    with contextlib.suppress(OSError), open(
                        os.path.join(tmp, "pgbouncer.log")
                    ) as f:
                        log = f.read()[-2000:]
                    pytest.fail(f"pgbouncer did not start: {log}")
                time.sleep(0.1)
        yield b
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _connections(bouncer: Bouncer, app_name: str) -> Iterator[Connect]:
    opened: list[psycopg.Connection[Any]] = []

    def factory(autocommit: bool = True, dbname: str | None = None) -> psycopg.Connection[Any]:
        c = psycopg.connect(
            bouncer.dsn(dbname),
            autocommit=autocommit,
            prepare_threshold=None,
            application_name=app_name,
        )
        opened.append(c)
        return c

    try:
        yield factory
    finally:
        for c in opened:
            c.close()


@pytest.fixture
def via_bouncer(bouncer: Bouncer, app_name: str) -> Iterator[Connect]:
    """Connections through PgBouncer. psycopg's server-side prepared statements do not survive
    transaction pooling before PgBouncer 1.21, so they are off (prepare_threshold=None)."""
    with _connections(bouncer, app_name) as factory:
        yield factory


@pytest.fixture
def via_session(session_bouncer: Bouncer, app_name: str) -> Iterator[Connect]:
    """Connections through PgBouncer in session mode."""
    with _connections(session_bouncer, app_name) as factory:
        yield factory


@pytest.fixture
def via_statement(statement_bouncer: Bouncer, app_name: str) -> Iterator[Connect]:
    """Connections through PgBouncer in statement mode."""
    with _connections(statement_bouncer, app_name) as factory:
        yield factory


@pytest.fixture(params=["session", "transaction", "statement"])
def any_bouncer(request: pytest.FixtureRequest) -> Bouncer:
    """Each PgBouncer of the module in turn."""
    fixture = "bouncer" if request.param == "transaction" else f"{request.param}_bouncer"
    return cast(Bouncer, request.getfixturevalue(fixture))


# --- detection ------------------------------------------------------------------------------


@pytest.mark.parametrize("autocommit", [True, False])
def test_pg_lock_through_transaction_pooling_raises_unsupported_server(
    via_bouncer: Connect, other: psycopg.Connection[Any], name: str, autocommit: bool
) -> None:
    conn = via_bouncer(autocommit=autocommit)
    with pytest.raises(pglock.UnsupportedServer, match="pooler") as info, pglock.pg_lock(
        conn, name
    ):
        pytest.fail("the body ran without a usable lock")
    message = str(info.value)
    assert "xact_lock" in message and "lease" in message
    assert holders(other, name) == []
    # every later attempt is refused the same way, without a new probe
    with pytest.raises(pglock.UnsupportedServer):
        pglock.pg_lock(conn, name).acquire(timeout=0)
    with pytest.raises(pglock.UnsupportedServer):
        pglock.pg_lock(conn, [name, f"{name}:2"], shared=True).acquire(timeout=1)
    assert holders(other, name) == []
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_pg_lock_inside_a_transaction_through_pgbouncer(
    via_bouncer: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    conn = via_bouncer()
    with conn.transaction():
        with pytest.raises(pglock.UnsupportedServer):
            pglock.pg_lock(conn, name).acquire()
        conn.execute("SELECT 1")  # the caller's transaction is still usable
    assert holders(other, name) == []


def test_pool_lock_through_pgbouncer_raises_and_keeps_the_connection(
    bouncer: Bouncer, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    with psycopg_pool.ConnectionPool(
        bouncer.dsn(),
        min_size=1,
        max_size=1,
        kwargs={"application_name": app_name, "prepare_threshold": None},
        reset=pglock.reset_connection,
        open=False,
        timeout=10,
    ) as pool:
        pool.open(wait=True, timeout=10)
        with pytest.raises(pglock.UnsupportedServer, match="xact_lock"), pglock.pool_lock(
            pool, name, timeout=5
        ):
            pytest.fail("the body ran without a usable lock")
        assert holders(other, name) == []
        with pool.connection(timeout=10) as conn:
            conn.execute("SELECT 1")
        stats = pool.get_stats()
        # refused, not broken: the connection went back to the pool, none was replaced
        assert stats["connections_num"] == 1, stats
        assert stats.get("returns_bad", 0) == 0, stats


def test_direct_connection_is_not_mistaken_for_a_pooler(
    conn: psycopg.Connection[Any], other: psycopg.Connection[Any], name: str
) -> None:
    """Negative control of the detection: the same check passes on a direct session."""
    with pglock.pg_lock(conn, name):
        assert holders(other, name) == [conn.info.backend_pid]


def test_detection_costs_no_round_trip_per_acquire(
    pg_dsn: str, app_name: str, name: str
) -> None:
    """After the first use (one probe), a lock cycle sends exactly lock + unlock (counted on
    the wire: a waiting lock statement does not go through ``Cursor.execute``)."""
    conn = RecordingConnection.connect(pg_dsn, autocommit=True, application_name=app_name)
    try:
        with pglock.pg_lock(conn, name):
            pass
        conn.sent.clear()
        for _ in range(3):
            with pglock.pg_lock(conn, name):
                pass
        sent = conn.sent
        assert len(sent) == 6, sent
    finally:
        conn.close()


def test_raw_session_locks_through_transaction_pooling_break(
    via_bouncer: Connect, bouncer: Bouncer, other: psycopg.Connection[Any], name: str
) -> None:
    """Companion: what pglock refuses. Two clients of a one-connection pool share one server
    session, so the second "acquires" a lock the first holds (phantom re-entrancy)."""
    db_one = f"{bouncer.server['dbname']}_one"
    a = via_bouncer(dbname=db_one)
    b = via_bouncer(dbname=db_one)
    k = pglock.key(name)
    try:
        a.execute("SELECT pg_advisory_lock(%s)", (k,))
        assert b.execute("SELECT pg_try_advisory_lock(%s)", (k,)).fetchone() == (True,)
        assert len(holders(other, name)) == 1  # one server session "holds" it for both
        for c in (a, b):
            with pytest.raises(pglock.UnsupportedServer):
                pglock.pg_lock(c, name).acquire(timeout=0)
    finally:
        a.execute("SELECT pg_advisory_unlock_all()")
    assert holders(other, name) == []


# --- transaction locks work -------------------------------------------------------------------


def test_xact_lock_through_pgbouncer_excludes(
    via_bouncer: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    a, b = via_bouncer(), via_bouncer()
    with a.transaction():
        pglock.xact_lock(a, name)
        assert len(holders(other, name)) == 1
        with b.transaction():
            assert not pglock.try_xact_lock(b, name)
            with pytest.raises(pglock.LockNotAcquired):
                pglock.xact_lock(b, name, timeout=0.2)
    assert holders(other, name) == []
    with b.transaction():
        pglock.xact_lock(b, name, timeout=5)
        assert len(holders(other, name)) == 1
    assert holders(other, name) == []


def _counter_through_bouncer(
    pg_dsn: str,
    app_name: str,
    via_bouncer: Connect,
    name: str,
    *,
    locked: bool,
    threads: int = 4,
    rounds: int = 10,
) -> tuple[int, int]:
    """Lost-update oracle through PgBouncer: each section runs in a transaction on a bouncer
    connection (taking the transaction lock there), and the counter is read and written on a
    separate direct connection."""
    conns = [via_bouncer() for _ in range(threads)]

    @contextlib.contextmanager
    def section(i: int) -> Iterator[None]:
        with conns[i].transaction():
            if locked:
                pglock.xact_lock(conns[i], name, timeout=30)
            else:
                conns[i].execute("SELECT 1")
            yield

    v, _, acked = run_counter(pg_dsn, app_name, section, threads=threads, rounds=rounds)
    return v, acked


def test_xact_lock_mutual_exclusion_through_pgbouncer(
    pg_dsn: str, app_name: str, via_bouncer: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    v, acked = _counter_through_bouncer(pg_dsn, app_name, via_bouncer, name, locked=True)
    assert acked == 40
    assert v == acked
    assert holders(other, name) == []


def test_negative_control_through_pgbouncer_without_the_lock_loses_updates(
    pg_dsn: str, app_name: str, via_bouncer: Connect, name: str
) -> None:
    v, acked = _counter_through_bouncer(pg_dsn, app_name, via_bouncer, name, locked=False)
    assert acked == 40
    assert v < acked, "the oracle found no lost update without a lock: it proves nothing"


# --- leases (pglock._lease arrives with the leases issue) ---------------------------------------


def test_lease_through_pgbouncer(app_name: str, bouncer: Bouncer, name: str) -> None:
    """Leases run each operation in its own short transaction: they work through the pooler."""
    if bouncer.lease_db is None:
        pytest.skip("pglock._lease is not there yet (leases issue)")
    from pglock._lease import lease

    with psycopg_pool.ConnectionPool(
        bouncer.dsn(bouncer.lease_db),
        min_size=1,
        max_size=2,
        kwargs={"application_name": app_name, "prepare_threshold": None},
        open=False,
        timeout=10,
    ) as pool:
        pool.open(wait=True, timeout=10)
        with lease(pool, name, ttl=10, timeout=5) as held:
            first = held.token
            with pytest.raises(pglock.LockNotAcquired), lease(pool, name, ttl=10, timeout=0):
                pytest.fail("two holders of one lease")
        with lease(pool, name, ttl=10, timeout=5) as again:
            assert again.token > first


# --- session, transaction and statement pooling: which lock works where (issue 14) ----------


def _server_pid(conn: psycopg.Connection[Any]) -> int | None:
    """The server session pglock probed for ``conn`` (None before its first session lock)."""
    return _conn.state_for(conn).backend_pid


def _pool(bouncer: Bouncer, app_name: str, max_size: int = 2) -> Any:
    pool = psycopg_pool.ConnectionPool(
        bouncer.dsn(),
        min_size=1,
        max_size=max_size,
        kwargs={"application_name": app_name, "prepare_threshold": None},
        reset=pglock.reset_connection,
        open=False,
        timeout=10,
    )
    pool.open(wait=True, timeout=10)
    return pool


@pytest.mark.parametrize("autocommit", [True, False])
def test_session_pooling_auto_refuses_and_names_the_override(
    via_session: Connect, other: psycopg.Connection[Any], name: str, autocommit: bool
) -> None:
    """One connection cannot tell session pooling from transaction pooling (a lone client of
    transaction pooling gets the same server session every time), so ``auto`` refuses a pooler
    and says how to declare session pooling."""
    conn = via_session(autocommit=autocommit)
    with pytest.raises(pglock.UnsupportedServer, match='pooler="session"'), pglock.pg_lock(
        conn, name
    ):
        pytest.fail("the body ran without a usable lock")
    assert holders(other, name) == []
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    conn.execute("SELECT 1")


@pytest.mark.parametrize("autocommit", [True, False])
def test_session_pooling_declared_session_locks_exclude(
    via_session: Connect, other: psycopg.Connection[Any], name: str, autocommit: bool
) -> None:
    """Two clients of a session-mode PgBouncer, real contention: the second cannot take the
    lock while the first holds it, and takes it once it is released."""
    a, b = via_session(autocommit=autocommit), via_session(autocommit=autocommit)
    with pglock.pg_lock(a, name, pooler="session"):
        assert holders(other, name) == [_server_pid(a)]
        assert not pglock.pg_lock(b, name, pooler="session").acquire(timeout=0)
        waiting = pglock.pg_lock(b, name, pooler="session", timeout=0.3)
        assert not waiting.acquire()  # a wait with a timeout (the batch path) gives up too
        assert holders(other, name) == [_server_pid(a)]
        assert a.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert holders(other, name) == []
    with pglock.pg_lock(b, [name, f"{name}:2"], pooler="session", timeout=5):
        assert holders(other, name) == [_server_pid(b)] != [_server_pid(a)]
        assert holders(other, f"{name}:2") == [_server_pid(b)]
    assert holders(other, name) == holders(other, f"{name}:2") == []
    # all or nothing: a try of two names, one held elsewhere, gives back the one it got
    with pglock.pg_lock(a, f"{name}:2", pooler="session"):
        assert not pglock.pg_lock(b, [name, f"{name}:2"], pooler="session").acquire(timeout=0)
        assert holders(other, name) == []
    # shared locks coexist
    with pglock.pg_lock(a, name, shared=True, pooler="session"), pglock.pg_lock(
        b, name, shared=True, pooler="session", timeout=5
    ):
        assert sorted(holders(other, name)) == sorted([_server_pid(a), _server_pid(b)])
    assert holders(other, name) == holders(other, f"{name}:2") == []


def test_session_pooling_lock_in_the_callers_transaction_survives_its_rollback(
    via_session: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    conn = via_session()
    lock = pglock.pg_lock(conn, name, pooler="session")
    with conn.transaction(force_rollback=True):
        assert lock.acquire(timeout=5)
    assert holders(other, name) == [_server_pid(conn)]
    lock.release()  # the mark rolled back with the transaction: the unlock sets nothing
    assert holders(other, name) == []


def test_session_pooling_pool_lock_and_locker_with_the_override(
    session_bouncer: Bouncer, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    with _pool(session_bouncer, app_name) as pool, _connections(
        session_bouncer, app_name
    ) as connect:
        with pytest.raises(pglock.UnsupportedServer, match='pooler="session"'):
            pglock.pool_lock(pool, name, timeout=5).acquire()
        rival = connect()
        locker = pglock.Locker(pool, pooler="session")
        for lock in (pglock.pool_lock(pool, name, pooler="session", timeout=5), locker.lock(name)):
            with lock as conn:
                assert holders(other, name) == [_server_pid(conn)]
                assert not pglock.pg_lock(rival, name, pooler="session").acquire(timeout=0)
            assert holders(other, name) == []
        stats = pool.get_stats()
        assert stats.get("returns_bad", 0) == 0, stats


def test_session_pooling_a_pooled_connection_keeps_its_mark_across_resets(
    session_bouncer: Bouncer, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    """The pool reset drops pglock's bookkeeping of a connection, not the mark its server
    session carries: the next checkout of the same connection is the same client."""
    with _pool(session_bouncer, app_name, max_size=1) as pool:
        pids = set()
        for _ in range(3):
            with pglock.pool_lock(pool, name, pooler="session", timeout=5) as conn:
                pids.add(_server_pid(conn))
                assert holders(other, name) == [_server_pid(conn)]
        assert len(pids) == 1  # one connection, one server session, checked out three times
        assert holders(other, name) == []


def test_session_pooling_none_skips_every_check(
    via_session: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    """``pooler="none"``: no pid comparison and no mark, the statements of a direct connection
    (the caller vouches that nothing shares the server session)."""
    conn = via_session()
    with pglock.pg_lock(conn, name, pooler="none"):
        row = conn.execute("SELECT pg_backend_pid(), current_setting('pglock.client', true)")
        pid, mark = row.fetchone() or (None, None)
        assert holders(other, name) == [pid]
        assert not mark  # the sharing checks never ran
    assert holders(other, name) == []


def test_session_pooling_xact_lock_excludes(
    via_session: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    a, b = via_session(), via_session()
    with a.transaction():
        pglock.xact_lock(a, name)
        assert len(holders(other, name)) == 1
        with b.transaction():
            assert not pglock.try_xact_lock(b, name)
    assert holders(other, name) == []


@pytest.mark.parametrize("autocommit", [True, False])
def test_statement_pooling_refuses_session_locks(
    via_statement: Connect, other: psycopg.Connection[Any], name: str, autocommit: bool
) -> None:
    """Statement pooling: ``auto`` refuses, nothing held. A non-autocommit connection that
    only sends pglock's statements never opens a transaction, which statement pooling kills."""
    conn = via_statement(autocommit=autocommit)
    with pytest.raises(pglock.UnsupportedServer, match="pooler"):
        pglock.pg_lock(conn, name).acquire(timeout=1)
    with pytest.raises(pglock.UnsupportedServer, match="pooler"):
        pglock.pg_lock(conn, name, pooler="transaction").acquire()
    assert holders(other, name) == []
    assert not conn.closed
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_statement_pooling_pool_lock_refused(
    statement_bouncer: Bouncer, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    with _pool(statement_bouncer, app_name) as pool:
        with pytest.raises(pglock.UnsupportedServer), pglock.pool_lock(pool, name, timeout=5):
            pytest.fail("the body ran without a usable lock")
        assert holders(other, name) == []
        stats = pool.get_stats()
        assert stats["connections_num"] == 1, stats


def test_statement_pooling_has_no_transactions_for_xact_lock(
    via_statement: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    """What really happens: a transaction lock needs a transaction, and PgBouncer in statement
    mode ends any client that opens one (08P01 "transaction blocks not allowed in statement
    pooling mode"): the connection is closed, nothing stays held. Without a transaction,
    xact_lock refuses (it would be released at once)."""
    conn = via_statement(autocommit=True)
    with pytest.raises(pglock.InvalidConnectionState):
        pglock.xact_lock(conn, name)
    assert not conn.closed
    tx = via_statement(autocommit=False)
    with pytest.raises(psycopg.OperationalError) as info:
        pglock.xact_lock(tx, name)  # BEGIN, then the lock: PgBouncer hangs up
    assert "statement pooling" in str(info.value)
    assert tx.closed or tx.broken
    assert holders(other, name) == []


@pytest.mark.parametrize("mode", ["transaction", "statement"])
def test_declared_session_pooling_sharing_detected_nothing_granted_twice(
    request: pytest.FixtureRequest, app_name: str, other: psycopg.Connection[Any], name: str,
    mode: str,
) -> None:
    """``pooler="session"`` declared wrongly: two clients of a one-connection pool share one
    server session; the second finds the first's mark, is refused, and later calls refuse
    without SQL. Nothing was granted twice: one unlock by the holder frees the key (a
    session granted the key twice would still hold it)."""
    bouncer = request.getfixturevalue("bouncer" if mode == "transaction" else f"{mode}_bouncer")
    db = f"{bouncer.server['dbname']}_one"
    with _connections(bouncer, app_name) as connect:
        a, b = connect(dbname=db), connect(dbname=db)
        first = pglock.pg_lock(a, name, pooler="session")
        assert first.acquire(timeout=5)
        assert holders(other, name) == [_server_pid(a)]
        with pytest.raises(pglock.UnsupportedServer, match="transaction pooling observed"):
            pglock.pg_lock(b, name, pooler="session").acquire(timeout=5)
        assert _server_pid(b) == _server_pid(a)  # really one server session for both
        assert "another client's mark" in str(_conn.state_for(b).sharing)
        with pytest.raises(pglock.UnsupportedServer, match="transaction pooling observed"):
            pglock.pg_lock(b, f"{name}:2", pooler="session").acquire(timeout=0)
        assert holders(other, f"{name}:2") == []
        first.release()
        assert holders(other, name) == []
        a.execute("SELECT set_config('pglock.client', '', false)")  # leave the session clean


def test_transaction_pooling_release_on_another_server_session_is_lost(
    bouncer: Bouncer, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    """``pooler="session"`` declared wrongly, and the holder's next statement lands on another
    server session (its first one is busy with another client's transaction): the unlock
    there takes nothing, the lock is reported lost, and the other client, now on the first
    server session, finds the holder's mark and is refused."""
    db = f"{bouncer.server['dbname']}_two"
    with _connections(bouncer, app_name) as connect:
        a, b = connect(dbname=db), connect(dbname=db)
        lock = pglock.pg_lock(a, name, pooler="session")
        assert lock.acquire(timeout=5)
        first = _server_pid(a)
        assert holders(other, name) == [first]
        with b.transaction():
            # PgBouncer hands out its most recently used server connection: a's.
            row = b.execute("SELECT pg_backend_pid()").fetchone()
            assert row == (first,), "PgBouncer gave b another server session"
            with pytest.raises(pglock.LockLost, match="transaction pooling observed"):
                lock.release()
            assert "not pid" in str(_conn.state_for(a).sharing)
            assert holders(other, name) == [first]  # it stays with the first server session
            with pytest.raises(pglock.UnsupportedServer, match="another client's mark"):
                pglock.pg_lock(b, f"{name}:b", pooler="session").acquire(timeout=0)
            # clean up the orphan from the session that holds it
            b.execute("SELECT pg_advisory_unlock_all(), set_config('pglock.client', '', false)")
        assert holders(other, name) == []


def test_transaction_override_refuses_even_a_direct_connection(
    pg_dsn: str, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    """``pooler="transaction"`` refuses a session lock at once, before any statement."""
    conn = RecordingConnection.connect(pg_dsn, autocommit=True, application_name=app_name)
    try:
        with pytest.raises(pglock.UnsupportedServer, match='pooler="transaction"'):
            pglock.pg_lock(conn, name, pooler="transaction").acquire(timeout=0)
        assert conn.sent == []
        assert holders(other, name) == []
        # declared for the connection: a later "auto" call refuses too
        with pytest.raises(pglock.UnsupportedServer, match='pooler="transaction"'):
            pglock.pg_lock(conn, name).acquire(timeout=0)
        with pglock.pg_lock(conn, name, pooler="none"):  # a new declaration replaces it
            assert holders(other, name) == [conn.info.backend_pid]
    finally:
        conn.close()


def test_session_override_on_a_direct_connection_sends_the_direct_statements(
    pg_dsn: str, app_name: str, name: str
) -> None:
    """Pids that match mean no pooler: ``pooler="session"`` keeps the lock + unlock cycle."""
    conn = RecordingConnection.connect(pg_dsn, autocommit=True, application_name=app_name)
    try:
        with pglock.pg_lock(conn, name, pooler="session"):
            pass
        conn.sent.clear()
        with pglock.pg_lock(conn, name, pooler="session"):
            pass
        assert len(conn.sent) == 2, conn.sent
        assert "pglock.client" not in " ".join(conn.sent)
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("value", "error"), [("bogus", ValueError), ("Session", ValueError), (None, TypeError),
                         (1, TypeError)]
)
def test_bad_pooler_values_are_refused_before_any_sql(
    pg_dsn: str, app_name: str, name: str, value: Any, error: type[Exception]
) -> None:
    conn = RecordingConnection.connect(pg_dsn, autocommit=True, application_name=app_name)
    try:
        with pytest.raises(error, match="pooler"):
            pglock.pg_lock(conn, name, pooler=value)
        with pytest.raises(error, match="pooler"):
            pglock.Locker(pg_dsn, pooler=value)
        pool = psycopg_pool.ConnectionPool(pg_dsn, min_size=1, open=False)  # never opened
        with pytest.raises(error, match="pooler"):
            pglock.pool_lock(pool, name, pooler=value)
        assert conn.sent == []
    finally:
        conn.close()


def test_xact_lock_and_lease_through_every_pooling_mode(
    any_bouncer: Bouncer, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    """Leases run each operation in its own short transaction, inside one statement where
    statement pooling allows no transaction: they work in all three modes. Transaction locks
    work wherever a transaction can be opened (session and transaction pooling)."""
    if any_bouncer.mode != "statement":
        with _connections(any_bouncer, app_name) as connect:
            a, b = connect(), connect()
            with a.transaction():
                pglock.xact_lock(a, name, timeout=5)
                with b.transaction():
                    assert not pglock.try_xact_lock(b, name)
            assert holders(other, name) == []
    if any_bouncer.lease_db is None:
        pytest.skip("pglock._lease is not there yet (leases issue)")
    with psycopg_pool.ConnectionPool(
        any_bouncer.dsn(any_bouncer.lease_db),
        min_size=1,
        max_size=2,
        kwargs={"application_name": app_name, "prepare_threshold": None},
        open=False,
        timeout=10,
    ) as pool:
        pool.open(wait=True, timeout=10)
        with pglock.lease(pool, name, ttl=10, timeout=5) as held:
            first = held.token
            with pytest.raises(pglock.LockNotAcquired), pglock.lease(pool, name, ttl=10, timeout=0):
                pytest.fail("two holders of one lease")
            held.extend(ttl=20)
        locker = pglock.Locker(pool)
        with locker.lease(name, ttl=10, timeout=5) as again:
            assert again.token > first


# --- the other session-lock APIs take pooler= too ----------------------------------------------


def test_session_pooling_rwlock_and_singleton_with_the_override(
    session_bouncer: Bouncer, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    with _connections(session_bouncer, app_name) as connect, _pool(
        session_bouncer, app_name
    ) as pool:
        a, b = connect(), connect()
        with pytest.raises(pglock.UnsupportedServer, match='pooler="session"'):
            pglock.rwlock(a, name).write().acquire(timeout=0)
        assert holders(other, name) == []
        with pglock.rwlock(a, name, pooler="session").write(timeout=0):
            assert holders(other, name) == [_server_pid(a)]
            assert not pglock.rwlock(b, name, pooler="session").read().acquire(timeout=0)
        with pglock.rwlock(a, name, pooler="session").read(), pglock.rwlock(
            b, name, pooler="session"
        ).read(timeout=5):
            assert len(holders(other, name)) == 2
        assert holders(other, name) == []

        ran: list[int] = []
        job = pglock.singleton(pool, name, pooler="session")(lambda: ran.append(1))
        with pglock.rwlock(a, name, pooler="session").write():
            assert job() is None  # held elsewhere: skipped
        job()
        assert ran == [1]
        with pytest.raises(pglock.UnsupportedServer):
            pglock.singleton(pool, name)(lambda: ran.append(2))()
        assert ran == [1] and holders(other, name) == []


def test_session_pooling_leader_and_migration_lock_with_the_override(
    session_bouncer: Bouncer, app_name: str, other: psycopg.Connection[Any], name: str
) -> None:
    dsn = make_conninfo(session_bouncer.dsn(), application_name=app_name)
    with pglock.leader(dsn, name, pooler="session", check_interval=0.2) as election:
        assert election.wait_elected(timeout=10)
        assert election.term is not None
        assert len(holders(other, name)) == 1
    assert holders(other, name) == []
    with migration_lock(dsn, name, timeout=5, pooler="session"):
        assert len(holders(other, name)) == 1
    assert holders(other, name) == []
    refused = pytest.raises(pglock.UnsupportedServer, match='pooler="session"')
    with refused, migration_lock(dsn, name, timeout=5):
        pytest.fail("the body ran without a usable lock")
    with pglock.Locker(dsn, pooler="session") as locker:
        with locker.rwlock(name).write(timeout=5):
            assert len(holders(other, name)) == 1
        with locker.leader(name, check_interval=0.2) as election:
            assert election.wait_elected(timeout=10)
    assert holders(other, name) == []


def test_pooler_is_checked_before_any_io_by_every_session_lock_api(name: str) -> None:
    dsn = "host=203.0.113.1 connect_timeout=1 dbname=nowhere"  # never reached
    pool = psycopg_pool.ConnectionPool(dsn, open=False)  # never opened
    for bad, error in (("sessions", ValueError), (1, TypeError)):
        with pytest.raises(error, match="pooler"):
            pglock.rwlock(pool, name, pooler=bad)  # type: ignore[arg-type]
        with pytest.raises(error, match="pooler"):
            pglock.leader(dsn, name, pooler=bad)  # type: ignore[arg-type]
        with pytest.raises(error, match="pooler"):
            pglock.singleton(pool, name, pooler=bad)  # type: ignore[arg-type]
        with pytest.raises(error, match="pooler"):
            migration_lock(dsn, name, pooler=bad)  # type: ignore[arg-type]


def test_session_pooling_none_survives_a_wait_cut_short_by_the_sessions_own_timeout(
    via_session: Connect, other: psycopg.Connection[Any], name: str
) -> None:
    """A wait that the session's own statement_timeout cuts short is sent again with the
    connection's declared pooler (it once fell back to "auto" and refused the pooler)."""
    a, b = via_session(), via_session()
    with pglock.pg_lock(b, f"{name}:probe", pooler="none"):
        pass  # probed before the session gets a timeout of its own: pglock learns it late
    b.execute("SET statement_timeout = '100ms'")
    out: list[Any] = []

    def waiter() -> None:
        try:
            with pglock.pg_lock(b, name, pooler="none"):  # waits past the 100 ms timeout
                out.append(holders(other, name))
        except BaseException as exc:
            out.append(exc)

    held = pglock.pg_lock(a, name, pooler="none")
    assert held.acquire(timeout=0)
    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.5)  # several of b's statement timeouts
    held.release()
    thread.join(20)
    assert not thread.is_alive(), "the waiter was still blocked 20 s after the release"
    pid = b.execute("SELECT pg_backend_pid()").fetchone()
    assert pid is not None and out == [[pid[0]]], out
    assert holders(other, name) == []
