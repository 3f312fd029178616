"""A primary and a streaming standby on 127.0.0.1, for failover tests (T29).

Both are throwaway :class:`~.cluster.Cluster` objects: the primary from ``initdb`` with
``wal_level = replica``, the standby from ``pg_basebackup -R`` (``primary_conninfo`` and
``standby.signal``) on a port of its own. Replication is synchronous
(``synchronous_standby_names = '*'``: a commit returns once the standby has flushed it) or
asynchronous. Operations: :meth:`Replicated.cut` (the standby stops receiving: the primary's
later commits never reach it), :meth:`Replicated.kill_primary` (``pg_ctl stop -m immediate``),
:meth:`Replicated.promote` (``pg_ctl promote``), :meth:`Replicated.wait_caught_up`, and
:meth:`Replicated.conninfo`, a multi-host conninfo (``target_session_attrs=read-write``) that
libpq tries in order: the primary, then the standby once it is promoted.

Every wait is bounded; :meth:`Replicated.destroy` stops and removes both clusters.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from .cluster import Cluster, ClusterUnavailable, find_bindir

#: Settings of both servers (the standby must be able to become a primary).
REPLICATION_SETTINGS: dict[str, object] = {
    "wal_level": "replica",
    "max_wal_senders": 5,
    "wal_keep_size": "64MB",
    "hot_standby": "on",
    "wal_receiver_status_interval": 1,
    "synchronous_commit": "on",  # the Cluster default is off: grants must reach the WAL
}


class Replicated:
    """A primary and one streaming standby (use as a context manager, or :meth:`destroy`).

    :param sync: synchronous replication (a commit waits for the standby's flush) or not.
    :param settings: extra settings for both servers.
    """

    def __init__(self, *, sync: bool, settings: Mapping[str, object] | None = None) -> None:
        self.sync = sync
        base = {**REPLICATION_SETTINGS, **(settings or {})}
        bindir = find_bindir()
        if not (bindir / "pg_basebackup").exists():
            raise ClusterUnavailable(f"no pg_basebackup in {bindir}")
        self.standby: Cluster | None = None
        self.primary = Cluster(
            {**base, "synchronous_standby_names": "*" if sync else ""}, prefix="pglock-primary-"
        )
        try:
            _trust_replication(self.primary)
            self.primary.start()
            # A promoted standby has no standby of its own: it must not wait for one.
            self.standby = Cluster(
                {**base, "synchronous_standby_names": ""}, prefix="pglock-standby-", init=False
            )
            self.standby._cmd(
                str(self.standby.bindir / "pg_basebackup"), "-h", "127.0.0.1",
                "-p", str(self.primary.port), "-U", "postgres", "-D", str(self.standby.data),
                "-R", "-X", "stream", "-c", "fast", "--no-sync", timeout=120,
            )
            self.standby.write_conf()  # its own port and socket directory over the copy's
            self.standby.start()
            self.wait_streaming()
        except BaseException:
            self.destroy()
            raise

    # -- state ---------------------------------------------------------------------------

    def _standby(self) -> Cluster:
        assert self.standby is not None
        return self.standby

    def conninfo(self, dbname: str = "postgres", **params: Any) -> str:
        """The multi-host conninfo clients use: primary first, then the standby, read-write."""
        ports = f"{self.primary.port},{self._standby().port}"
        params.setdefault("connect_timeout", 2)
        return make_conninfo(
            "", host="127.0.0.1,127.0.0.1", port=ports, dbname=dbname, user="postgres",
            target_session_attrs="read-write", **params,
        )

    def query(self, cluster: Cluster, statement: str, params: tuple[Any, ...] = ()) -> Any:
        """The first row of ``statement`` on ``cluster`` (a connection of its own)."""
        with psycopg.connect(cluster.dsn(), autocommit=True, connect_timeout=5) as c:
            return c.execute(statement, params).fetchone()

    def wait_streaming(self, timeout: float = 30) -> None:
        """Until the primary has a streaming standby (its sync_state as configured)."""
        want = "sync" if self.sync else "async"
        _until(
            lambda: self.query(
                self.primary,
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
                " AND sync_state = %s", (want,),
            )[0] == 1,
            timeout, f"a {want} streaming standby",
        )

    def wait_caught_up(self, timeout: float = 30) -> None:
        """Until the standby has replayed everything the primary has inserted into its WAL so
        far, commits made with ``synchronous_commit = off`` included."""
        with psycopg.connect(self.primary.dsn(), autocommit=True, connect_timeout=5) as c:
            row = c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
            assert row is not None
            target = row[0]
            # A durable commit flushes the WAL before it (the WAL writer may leave a record
            # that no commit follows unflushed, and unsent, for seconds).
            with c.transaction():
                c.execute("SET LOCAL synchronous_commit = local")
                c.execute("SELECT pg_current_xact_id()")
        _until(
            lambda: self.query(
                self._standby(), "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)
            )[0],
            timeout, f"the standby to replay up to {target}",
        )

    def lag(self) -> int:
        """Bytes of WAL the primary has written that the standby has not replayed."""
        written = self.query(self.primary, "SELECT pg_current_wal_lsn()::text")[0]
        row = self.query(
            self._standby(), "SELECT pg_wal_lsn_diff(%s::pg_lsn, pg_last_wal_replay_lsn())",
            (written,),
        )
        return int(row[0])

    # -- faults --------------------------------------------------------------------------

    def cut(self, timeout: float = 30) -> None:
        """Stop replication: the standby's ``primary_conninfo`` becomes '' (reloaded, PG 13+);
        the primary's commits from now on never reach it. Async only: a synchronous primary
        would wait for the standby forever."""
        if self.sync:
            raise RuntimeError("cutting a synchronous standby would block every commit")
        standby = self._standby()
        auto = standby.data / "postgresql.auto.conf"
        text, n = re.subn(r"(?m)^primary_conninfo\s*=.*$", "primary_conninfo = ''",
                          auto.read_text())
        assert n == 1, f"no primary_conninfo in {auto}"
        auto.write_text(text)
        standby._cmd(str(standby.bindir / "pg_ctl"), "-D", str(standby.data), "reload")
        _until(
            lambda: self.query(standby, "SELECT count(*) FROM pg_stat_wal_receiver")[0] == 0,
            timeout, "the standby's WAL receiver to stop",
        )
        _until(
            lambda: self.query(self.primary, "SELECT count(*) FROM pg_stat_replication")[0] == 0,
            timeout, "the primary's WAL sender to stop",
        )

    def kill_primary(self) -> None:
        """``pg_ctl stop -m immediate``: the primary dies without a shutdown checkpoint."""
        self.primary.stop("immediate")

    def promote(self, timeout: float = 60) -> float:
        """Promote the standby (``pg_ctl promote -w``); return ``time.monotonic()`` once it
        accepts writes."""
        standby = self._standby()
        standby._cmd(
            str(standby.bindir / "pg_ctl"), "-D", str(standby.data), "-w", "-t", str(int(timeout)),
            "promote", timeout=timeout + 10,
        )
        _until(
            lambda: not self.query(standby, "SELECT pg_is_in_recovery()")[0],
            timeout, "the promoted standby to leave recovery",
        )
        return time.monotonic()

    def failover(self) -> float:
        """Kill the primary, promote the standby; ``time.monotonic()`` when it is promoted."""
        self.kill_primary()
        return self.promote()

    def timeline(self, cluster: Cluster) -> int:
        """The WAL timeline ``cluster`` writes on (1 before any promotion)."""
        walfile = self.query(cluster, "SELECT pg_walfile_name(pg_current_wal_lsn())")[0]
        return int(walfile[:8], 16)

    def destroy(self) -> None:
        for c in (self.standby, self.primary):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.destroy()

    def __enter__(self) -> Replicated:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _trust_replication(cluster: Cluster) -> None:
    hba = cluster.data / "pg_hba.conf"
    line = "host replication all 127.0.0.1/32 trust\n"
    text = hba.read_text()
    if line not in text:
        hba.write_text(text + line)


def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except psycopg.OperationalError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
