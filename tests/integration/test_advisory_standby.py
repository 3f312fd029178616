"""A hot standby is refused: its advisory locks are local to it and coordinate nothing.

Starts a throwaway primary and a streaming standby (initdb, pg_basebackup, pg_ctl) on free
ports in a temporary directory, as the ``postgres`` OS user when the tests run as root.
Takes a few seconds; never touches the shared test server.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pglock


def _bindir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    for d in reversed(found):
        if os.path.exists(os.path.join(d, "pg_basebackup")):
            return d
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb and shutil.which("pg_basebackup") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """Runs the Postgres programs as the postgres OS user when we are root."""

    def __init__(self, bindir: str, tmp: str) -> None:
        self.bindir = bindir
        self.tmp = tmp
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            self.prefix = ["runuser", "-u", "postgres", "--"]
            pw = pwd.getpwnam("postgres")
            os.chown(tmp, pw.pw_uid, pw.pw_gid)
        self.started: list[str] = []

    def run(self, prog: str, *args: str) -> None:
        cmd = [*self.prefix, os.path.join(self.bindir, prog), *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{prog} failed ({out.returncode}): {out.stdout}\n{out.stderr}")

    def start(self, datadir: str, port: int) -> None:
        opts = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.tmp}"
        log = os.path.join(self.tmp, f"{os.path.basename(datadir)}.log")
        self.run("pg_ctl", "start", "-w", "-t", "30", "-D", datadir, "-l", log, "-o", opts)
        self.started.append(datadir)

    def stop_all(self) -> None:
        for datadir in reversed(self.started):
            with contextlib.suppress(Exception):
                self.run("pg_ctl", "stop", "-m", "immediate", "-w", "-D", datadir)


@pytest.fixture(scope="module")
def standby() -> Iterator[tuple[str, str]]:
    """(primary DSN, standby DSN) of a throwaway streaming-replication pair."""
    bindir = _bindir()
    if bindir is None or (os.geteuid() == 0 and not _has_user("postgres")):
        msg = "needs the Postgres server programs (initdb, pg_basebackup, pg_ctl)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    tmp = tempfile.mkdtemp(prefix="pglock-standby-")
    cluster = Cluster(bindir, tmp)
    primary, replica = os.path.join(tmp, "primary"), os.path.join(tmp, "standby")
    p1, p2 = _free_port(), _free_port()
    try:
        cluster.run("initdb", "-D", primary, "-A", "trust", "-U", "postgres", "-N")
        with open(os.path.join(primary, "postgresql.conf"), "a") as f:
            f.write("fsync = off\nwal_level = replica\nmax_wal_senders = 4\n")
        cluster.start(primary, p1)
        cluster.run(
            "pg_basebackup", "-D", replica, "-R", "-X", "stream", "-c", "fast",
            "-h", "127.0.0.1", "-p", str(p1), "-U", "postgres",
        )  # fmt: skip
        cluster.start(replica, p2)
        yield (
            f"postgresql://postgres@127.0.0.1:{p1}/postgres",
            f"postgresql://postgres@127.0.0.1:{p2}/postgres",
        )
    finally:
        cluster.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _advisory(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT pid, mode FROM pg_locks WHERE locktype = 'advisory' AND granted"
    ).fetchall()


def test_hot_standby_is_refused(standby: tuple[str, str]) -> None:
    primary_dsn, standby_dsn = standby
    name = f"test:{uuid.uuid4()}"
    with (
        psycopg.connect(standby_dsn, autocommit=True) as s,
        psycopg.connect(standby_dsn, autocommit=True) as obs,
    ):
        assert s.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
        with pytest.raises(pglock.UnsupportedServer, match="hot standby"):
            pglock.pg_lock(s, name).acquire()
        with (
            pytest.raises(pglock.UnsupportedServer, match="hot standby"),
            pglock.pg_lock(s, name, timeout=0),
        ):
            pytest.fail("the body ran")
        assert _advisory(obs) == []
        assert s.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with s.transaction(), pytest.raises(pglock.UnsupportedServer):
            pglock.xact_lock(s, name)
        assert _advisory(obs) == []
        # Negative control: the standby itself would happily grant the lock, which is exactly
        # why pglock must refuse it (nothing on the primary would see it).
        assert s.execute("SELECT pg_try_advisory_lock(%s)", (pglock.key(name),)).fetchone() == (
            True,
        )
        # The primary does not see the standby's lock.
        with psycopg.connect(primary_dsn, autocommit=True) as p, pglock.pg_lock(p, name, timeout=0):
            assert p.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
        s.execute("SELECT pg_advisory_unlock_all()")


def test_non_autocommit_standby_connection_left_idle(standby: tuple[str, str]) -> None:
    _, standby_dsn = standby
    with psycopg.connect(standby_dsn) as s:
        with pytest.raises(pglock.UnsupportedServer):
            pglock.pg_lock(s, f"test:{uuid.uuid4()}").acquire()
        assert s.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
