"""Helpers of the review's attack tests (imported as ``_review``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg


def held_keys(dsn: str, keys: Sequence[int]) -> list[tuple[int, str, bool]]:
    """(pid, mode, granted) of every pg_locks row on one of ``keys`` in this database, read by an
    independent session with default settings."""
    with psycopg.connect(dsn, autocommit=True, application_name="review-observer") as o:
        return o.execute(
            "SELECT l.pid, l.mode, l.granted FROM pg_locks l"
            " WHERE l.locktype = 'advisory' AND l.objsubid = 1"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY(%s)"
            " ORDER BY l.pid",
            (list(keys),),
        ).fetchall()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a daemon thread; the dict gets ``result`` or ``error``."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def backend_waiting(dsn: str, pid: int) -> bool:
    """Is backend ``pid`` waiting on an advisory lock?"""
    with psycopg.connect(dsn, autocommit=True, application_name="review-observer") as o:
        row = o.execute(
            "SELECT wait_event_type = 'Lock' AND wait_event = 'advisory'"
            " FROM pg_stat_activity WHERE pid = %s",
            (pid,),
        ).fetchone()
    return bool(row and row[0])


class DelayingProxy:
    """A TCP proxy in front of Postgres that forwards every session unchanged and holds each
    *cancel request* for ``delay`` seconds before forwarding it (a slow network to the server,
    as a cross-region client sees it, for cancels). Use ``sslmode=disable gssencmode=disable``
    so that the first packet is the startup or the cancel packet."""

    CANCEL_CODE = 80877102

    def __init__(self, host: str, port: int, delay: float) -> None:
        import socket

        self.upstream = (host, port)
        self.delay = delay
        self.cancels = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(32)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._open: list[Any] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            self._open.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    @staticmethod
    def _exactly(sock: Any, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data

    def _serve(self, client: Any) -> None:
        import socket
        import struct

        try:
            head = self._exactly(client, 8)
            length, code = struct.unpack("!ii", head)
            up = socket.create_connection(self.upstream)
            self._open.append(up)
            if code == self.CANCEL_CODE and length == 16:
                body = self._exactly(client, 8)
                self.cancels += 1
                time.sleep(self.delay)
                up.sendall(head + body)
                while up.recv(4096):
                    pass
                up.close()
                client.close()
                return
            up.sendall(head)
            threading.Thread(target=self._pump, args=(up, client), daemon=True).start()
            self._pump(client, up)
        except OSError:
            client.close()

    @staticmethod
    def _pump(src: Any, dst: Any) -> None:
        import socket

        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        for s in self._open:
            s.close()
