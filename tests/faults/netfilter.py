"""Drop a TCP connection's packets in the kernel: a real network blackhole on loopback.

A user-space proxy cannot fake a dead network on its own: the proxy's kernel still ACKs
keepalive probes and data, so neither Postgres nor libpq would ever notice the peer is gone.
:class:`Blackhole` adds iptables ``DROP`` rules for exactly one connection's 4-tuple (both
directions, loopback only), so keepalives and retransmissions go unanswered, as on a cut cable.
The rules are removed by :meth:`Blackhole.heal` (and by the fixtures that create them).

Needs root and the ``iptables`` command (Debian package ``iptables``); :func:`available` says.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
from typing import Any

_lock = threading.Lock()
_active: list[list[str]] = []


def available() -> str | None:
    """None when blackholes work here, else the reason they do not."""
    if os.geteuid() != 0:
        return "kernel blackholes need root (iptables)"
    if shutil.which("iptables") is None:
        return "kernel blackholes need the iptables command (Debian package 'iptables')"
    proc = subprocess.run(
        ["iptables", "-w", "5", "-L", "INPUT", "-n"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return f"iptables does not work here: {proc.stderr.strip()}"
    return None


def _rule(src_port: int, dst_port: int) -> list[str]:
    return [
        "INPUT",
        "-i",
        "lo",
        "-p",
        "tcp",
        "-s",
        "127.0.0.1",
        "-d",
        "127.0.0.1",
        "--sport",
        str(src_port),
        "--dport",
        str(dst_port),
        "-j",
        "DROP",
    ]


def _iptables(op: str, rule: list[str]) -> None:
    subprocess.run(["iptables", "-w", "5", op, *rule], check=True, capture_output=True, text=True)


def socket_ports(sock: socket.socket) -> tuple[int, int]:
    """(local port, remote port) of a connected loopback TCP socket."""
    return int(sock.getsockname()[1]), int(sock.getpeername()[1])


def conn_ports(conn: Any) -> tuple[int, int]:
    """(local port, server port) of a psycopg connection's TCP socket."""
    fd = conn.pgconn.socket
    s = socket.socket(fileno=os.dup(fd))
    try:
        return socket_ports(s)
    finally:
        s.close()


class Blackhole:
    """Drop every packet between two loopback ports, both ways, until :meth:`heal`."""

    def __init__(self, port_a: int, port_b: int) -> None:
        self.rules = [_rule(port_a, port_b), _rule(port_b, port_a)]
        self.active = False

    def cut(self) -> Blackhole:
        with _lock:
            for r in self.rules:
                _iptables("-I", r)
                _active.append(r)
        self.active = True
        return self

    def heal(self) -> None:
        with _lock:
            for r in self.rules:
                if r in _active:
                    with contextlib.suppress(subprocess.CalledProcessError):
                        _iptables("-D", r)
                    _active.remove(r)
        self.active = False


def heal_all() -> None:
    """Remove every rule this process added (a safety net for fixtures)."""
    with _lock:
        for r in list(_active):
            with contextlib.suppress(subprocess.CalledProcessError):
                _iptables("-D", r)
            _active.remove(r)
