"""A small threaded TCP proxy on 127.0.0.1 for network faults between a client and Postgres.

Upstream is a TCP address or, when ``upstream_host`` is a directory (libpq's convention), the
Unix-domain socket ``<dir>/.s.PGSQL.<port>`` of a server that listens on a socket only.

Modes (:meth:`Proxy.set_mode`, applied to every current and future connection):

``pass``
    forward both ways.
``blackhole``
    forward nothing, answer nothing. In user space alone the proxy's kernel still ACKs, so
    peers' keepalives keep succeeding; with ``kernel=True`` (root and iptables) the proxy also
    drops its connections' packets in the kernel, which is what a cut cable looks like
    (see :mod:`.netfilter`).
``drop_responses``
    forward client -> server, discard server -> client: requests run, their answers are lost
    (:attr:`Proxy.dropped` counts the chunks discarded).
``reset_on_response``
    forward client -> server; when the server answers, reset both sides (RST) instead of
    forwarding: the ambiguous acquire, where the request ran but the client never learns how.
    ``set_mode("reset_on_response", times=n)``: only the next ``n`` answers, then ``pass``.

:meth:`Proxy.reset_all` resets every current connection at once (both sides get an RST).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading

from . import netfilter

MODES = ("pass", "blackhole", "drop_responses", "reset_on_response")


def _rst_close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Pipe:
    def __init__(self, proxy: Proxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.closed = False
        self.blackholes: list[netfilter.Blackhole] = []
        self.thread = threading.Thread(target=self._run, name="proxy-pipe", daemon=True)

    def _run(self) -> None:
        socks = [self.client, self.server]
        try:
            while not self.closed and not self.proxy.closed:
                try:
                    readable, _, _ = select.select(socks, [], [], 0.05)
                except (OSError, ValueError):
                    break
                for s in readable:
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    if not data:
                        self.close(reset=False)
                        return
                    mode = self.proxy.mode
                    to_server = s is self.client
                    if mode == "blackhole":
                        continue
                    if not to_server and mode == "drop_responses":
                        self.proxy.dropped += 1
                        continue
                    if not to_server and mode == "reset_on_response":
                        self.proxy._count_reset()
                        self.close(reset=True)
                        return
                    dst = self.server if to_server else self.client
                    try:
                        dst.sendall(data)
                    except OSError:
                        self.close(reset=False)
                        return
        finally:
            if self.proxy.closed:
                self.close(reset=True)

    def apply_kernel_blackhole(self) -> None:
        if self.blackholes or self.closed:
            return
        try:
            c_local, c_remote = netfilter.socket_ports(self.client)
            server_tcp = self.server.family != socket.AF_UNIX  # no packets to drop on a socket
            s_local, s_remote = netfilter.socket_ports(self.server) if server_tcp else (0, 0)
        except OSError:
            return
        self.blackholes = [netfilter.Blackhole(c_remote, c_local).cut()]
        if server_tcp:
            self.blackholes.append(netfilter.Blackhole(s_local, s_remote).cut())

    def heal(self) -> None:
        for b in self.blackholes:
            b.heal()
        self.blackholes = []

    def close(self, *, reset: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.heal()
        if reset:
            _rst_close(self.client)
            _rst_close(self.server)
        else:
            for s in (self.client, self.server):
                with contextlib.suppress(OSError):
                    s.close()


class Proxy:
    """Listen on a free 127.0.0.1 port and forward each connection to ``upstream_port``.

    :param upstream_host: a TCP host, or a socket directory (an absolute path) for a server's
        Unix-domain socket ``<dir>/.s.PGSQL.<upstream_port>``.
    :param kernel: in ``blackhole`` mode, also drop the packets in the kernel (needs root and
        iptables; see :func:`netfilter.available`).
    """

    def __init__(
        self, upstream_port: int, upstream_host: str = "127.0.0.1", *, kernel: bool = False
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.kernel = kernel
        self.mode = "pass"
        self.closed = False
        self.resets = 0
        self.dropped = 0
        self._resets_left: int | None = None
        self.pipes: list[_Pipe] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = self._connect_upstream()
            except OSError:
                _rst_close(client)
                continue
            client.settimeout(None)
            pipe = _Pipe(self, client, server)
            with self._lock:
                self.pipes.append(pipe)
            if self.mode == "blackhole" and self.kernel:
                pipe.apply_kernel_blackhole()
            pipe.thread.start()

    def _connect_upstream(self) -> socket.socket:
        host, port = self.upstream
        if host.startswith("/"):
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.settimeout(5)
                server.connect(f"{host}/.s.PGSQL.{port}")
            except OSError:
                server.close()
                raise
        else:
            server = socket.create_connection(self.upstream, timeout=5)
        server.settimeout(None)
        return server

    def set_mode(self, mode: str, *, times: int | None = None) -> None:
        """Apply ``mode``; with ``times`` (``reset_on_response`` only), for that many resets."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if times is not None and (mode != "reset_on_response" or times < 1):
            raise ValueError("times is a positive count of reset_on_response answers")
        with self._lock:
            self._resets_left = times
            self.mode = mode
        with self._lock:
            pipes = [p for p in self.pipes if not p.closed]
        for p in pipes:
            if mode == "blackhole" and self.kernel:
                p.apply_kernel_blackhole()
            elif mode != "blackhole":
                p.heal()

    def _count_reset(self) -> None:
        with self._lock:
            self.resets += 1
            if self._resets_left is not None:
                self._resets_left -= 1
                if self._resets_left == 0:
                    self._resets_left = None
                    self.mode = "pass"

    def reset_all(self) -> None:
        """Reset every current connection (RST to both the client and the server)."""
        with self._lock:
            pipes = list(self.pipes)
        for p in pipes:
            p.close(reset=True)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.reset_all()
        self._thread.join(timeout=2)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
