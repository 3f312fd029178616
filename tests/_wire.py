"""What a connection really sends: statements read from libpq's protocol trace.

pglock runs its statements on a cursor of its own, whatever ``cursor_factory`` a connection
has, so a recording cursor or an overridden ``execute()`` sees none of them. libpq's trace
sees every message, whoever sends it. :class:`RecordingConnection` keeps one per connection
and reads it back as one entry per statement executed: the text of a simple query (several
``;``-joined statements are one entry, one round trip), or of an extended-protocol statement
(its ``Parse``, or the ``Parse`` that prepared the statement it binds). A ``Parse`` that only
prepares a statement (psycopg does that in a round trip of its own before the statement's
first prepared execution) is not an entry by itself.

Importable from every test module as ``_wire``.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from typing import Any

import psycopg
from psycopg import pq

#: One traced message: direction, length, type, and the rest (which may span lines).
_MESSAGE = re.compile(r"^([FB])\t\d+\t(\w+)\t?(.*)", re.S)


def _split(trace: str) -> list[tuple[str, str, str]]:
    parts = re.split(r"\n(?=[FB]\t\d+\t)", trace.strip("\n"))
    out = []
    for part in parts:
        m = _MESSAGE.match(part)
        if m:
            out.append((m.group(1), m.group(2), m.group(3).strip()))
    return out


def _query_text(rest: str) -> str:
    """The SQL of a traced ``Query`` (``"text"``): quotes inside it are not escaped, so it
    runs from the first quote to the last."""
    return rest[rest.index('"') + 1 : rest.rindex('"')]


def _parse_fields(rest: str) -> tuple[str, str]:
    """Name and SQL of a traced ``Parse`` (``"name" "text" nparams [type oids]``)."""
    m = re.match(r'"([^"]*)" "(.*)"(?: \d+)+$', rest, re.S)
    return (m.group(1), m.group(2)) if m else ("", "")


def _bound_name(rest: str) -> str:
    """The prepared statement a traced ``Bind`` (``"portal" "statement" ...``) executes."""
    m = re.match(r'"[^"]*" "([^"]*)"', rest)
    return m.group(1) if m else ""


def statements(trace: str) -> list[str]:
    """The statements a traced conversation executed, one entry per statement (see module)."""
    prepared: dict[str, str] = {}
    out: list[str] = []
    pending = ""
    bound = False
    for direction, kind, rest in _split(trace):
        if direction != "F":
            continue
        if kind == "Query":
            out.append(_query_text(rest))
        elif kind == "Parse":
            name, text = _parse_fields(rest)
            if name:
                prepared[name] = text
            pending = text
        elif kind == "Bind":
            bound = True
            name = _bound_name(rest)
            if name:
                pending = prepared.get(name, name)
        elif kind == "Sync":
            if bound:
                out.append(pending)
            pending, bound = "", False
    return out


class Sent(list[str]):
    """A snapshot of what a :class:`RecordingConnection` sent; ``clear()`` also forgets it on
    the connection, so ``conn.sent.clear()`` starts a new count."""

    def __init__(self, items: list[str], owner: RecordingConnection) -> None:
        super().__init__(items)
        self._owner = owner

    def clear(self) -> None:
        super().clear()
        self._owner.forget_sent()


class RecordingConnection(psycopg.Connection[Any]):
    """A psycopg connection that records every statement sent on it (see the module).

    libpq appends to a file of its own (``O_APPEND``: reading it never moves where libpq
    writes); closing the connection keeps what was recorded readable."""

    _trace_path: str | None = None
    _trace_fd: int | None = None
    _recorded = ""
    _forget_at = 0
    _lock = threading.Lock()
    #: Every recording connection opened, so a test can count over a pool's connections.
    instances: list[RecordingConnection] = []

    @classmethod
    def connect(cls, *args: Any, **kwargs: Any) -> Any:
        conn = super().connect(*args, **kwargs)
        conn.start_recording()
        with cls._lock:
            cls.instances.append(conn)
        return conn

    def start_recording(self) -> None:
        if self._trace_path is None:
            fd, self._trace_path = tempfile.mkstemp(prefix="pglock-wire-")
            os.close(fd)
            self._trace_fd = os.open(self._trace_path, os.O_WRONLY | os.O_APPEND)
            self.pgconn.trace(self._trace_fd)
            self.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        self.forget_sent()

    def _read(self) -> str:
        if self._trace_path is None:
            return self._recorded
        with open(self._trace_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def forget_sent(self) -> None:
        self._forget_at = len(self._read())

    @property
    def sent(self) -> Sent:
        """The statements sent since the connection opened or the last ``sent.clear()``."""
        return Sent(statements(self._read()[self._forget_at :]), self)

    @sent.setter
    def sent(self, value: list[str]) -> None:
        if value:
            raise ValueError("only an empty list resets what was sent")
        self.forget_sent()

    def close(self) -> None:
        if self._trace_path is not None:
            if not self.closed:
                self.pgconn.untrace()
            self._recorded = self._read()
            if self._trace_fd is not None:
                os.close(self._trace_fd)
            os.unlink(self._trace_path)
            self._trace_path = self._trace_fd = None
        super().close()
