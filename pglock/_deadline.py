"""Client-side deadlines: a statement or a connect that gets no answer in time is cut off (a
silent network sends no FIN or RST, and TCP would wait for minutes), its connection closed and
never reused. Which statement gets which deadline is decided by the callers (``_conn``, ``_ttl``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict

logger = logging.getLogger("pglock.deadline")

T = TypeVar("T")

#: libpq parameters for the connections pglock opens itself, unless the DSN (or the pool's
#: ``kwargs``) sets them: the kernel declares a silent peer dead within about 25 s on an idle
#: connection (keepalives) and 30 s with data unacknowledged (``tcp_user_timeout``, in ms).
CONNECT_DEFAULTS: Mapping[str, str] = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}
#: How long the watchdog thread lingers without anything to watch before it exits.
_WATCHDOG_IDLE = 30.0


class NoAnswer(psycopg.OperationalError):
    """A statement (or a connect) got no answer by its client-side deadline: pglock closed its
    connection. Whether the statement ran on the server is unknown, unless ``sent`` is False:
    then it never left the client (no connection, or no time left to send it)."""

    def __init__(self, *args: Any, sent: bool = True) -> None:
        super().__init__(*args)
        self.sent = sent


@dataclass(slots=True, eq=False)
class _Watch:
    """One armed deadline: the connection to cut off when it passes."""

    conn: psycopg.Connection[Any]
    deadline: float
    armed: bool = True
    fired: bool = False


class _Watchdog:
    """Cuts off statements still running at their deadline: one thread per process. Firing and
    disarming take the same lock, so a disarmed connection (maybe back in a pool) is never cut."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, _Watch]] = []
        self._armed = 0
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, conn: psycopg.Connection[Any], deadline: float) -> _Watch:
        watch = _Watch(conn, deadline)
        with self._lock:
            earliest = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, next(self._seq), watch))
            self._armed += 1
            if len(self._heap) > 4 * self._armed + 1024:
                # Disarmed entries leave the heap lazily; drop them when they pile up.
                self._heap = [e for e in self._heap if e[2].armed]
                heapq.heapify(self._heap)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="pglock-statement-watchdog", daemon=True
                )
                self._thread.start()
            elif earliest:
                self._cond.notify()
        return watch

    def disarm(self, watch: _Watch) -> bool:
        """Stop watching; True if the deadline had fired (the connection is cut off)."""
        with self._lock:
            if watch.armed:
                watch.armed = False
                self._armed -= 1
            return watch.fired

    def _run(self) -> None:
        with self._lock:
            while True:
                heap = self._heap
                while heap and not heap[0][2].armed:
                    heapq.heappop(heap)
                now = time.monotonic()
                if not heap:
                    if not self._cond.wait(_WATCHDOG_IDLE) and not self._heap:
                        self._thread = None
                        return
                    continue
                deadline, _, watch = heap[0]
                if deadline > now:
                    self._cond.wait(deadline - now)
                    continue
                heapq.heappop(heap)
                watch.armed = False
                watch.fired = True
                self._armed -= 1
                _cut_off(watch.conn)


def _cut_off(conn: psycopg.Connection[Any]) -> None:
    """Shut ``conn``'s socket down for both directions, without closing its descriptor (libpq
    owns it): a blocked read returns end-of-file at once."""
    try:
        dup = os.dup(conn.pgconn.socket)
    except Exception:  # closed meanwhile: nothing blocks on it
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        logger.debug("shutting a connection's socket down failed", exc_info=True)
    finally:
        sock.close()
    logger.debug("cut off a connection whose statement passed its deadline")


_watchdog = _Watchdog()


def within(
    conn: psycopg.Connection[Any], deadline: float | None, call: Callable[[], T], what: str
) -> T:
    """``call()`` (statements on ``conn``, named ``what`` in errors) cut off at ``deadline``
    (monotonic; None: never) with :class:`NoAnswer`, ``conn`` closed; one that returned as the
    deadline fired keeps its result, and its connection is closed all the same."""
    if deadline is None:
        return call()
    if time.monotonic() >= deadline:
        raise NoAnswer(f"pglock: no time left to send {what} (its deadline had passed)",
                       sent=False)
    watch = _watchdog.arm(conn, deadline)
    try:
        result = call()
    except BaseException as exc:
        if not _watchdog.disarm(watch):
            raise
        close_quietly(conn)
        if not isinstance(exc, Exception):
            raise
        raise NoAnswer(
            f"pglock: {what} got no answer by its deadline; its connection was closed "
            "(whether it ran on the server is unknown)"
        ) from exc
    if _watchdog.disarm(watch):
        close_quietly(conn)
    return result


def close_quietly(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.close()
    except Exception:
        logger.debug("closing a cut-off connection failed", exc_info=True)


def connect_extra(conninfo: str, kwargs: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The :data:`CONNECT_DEFAULTS` that neither ``conninfo`` nor ``kwargs`` set (nor, for
    ``connect_timeout``, the ``PGCONNECT_TIMEOUT`` environment variable)."""
    try:
        given = set(conninfo_to_dict(conninfo))
    except psycopg.ProgrammingError:
        given = set()
    if kwargs:
        given |= {k for k, v in kwargs.items() if v is not None}
    if os.environ.get("PGCONNECT_TIMEOUT"):
        given.add("connect_timeout")
    return {k: v for k, v in CONNECT_DEFAULTS.items() if k not in given}


def connect_within(
    connect: Callable[[], psycopg.Connection[Any]], deadline: float | None,
    late: Callable[[psycopg.Connection[Any]], None],
) -> psycopg.Connection[Any]:
    """``connect()`` in a thread of its own, given up at ``deadline`` with :class:`NoAnswer`
    (libpq's ``connect_timeout`` counts whole seconds, at least 2, per host); a connection that
    comes later goes to ``late`` (which keeps or closes it)."""
    if deadline is None:
        return connect()
    left = deadline - time.monotonic()
    if left <= 0:
        raise NoAnswer("pglock: no time left to open a connection (its deadline had passed)",
                       sent=False)
    lock = threading.Lock()
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            result: psycopg.Connection[Any] | BaseException = connect()
        except BaseException as exc:
            result = exc
        with lock:
            abandoned = "abandoned" in box
            if not abandoned:
                box["result"] = result
        done.set()
        if abandoned and not isinstance(result, BaseException):
            late(result)

    threading.Thread(target=run, name="pglock-connect", daemon=True).start()
    done.wait(left)
    with lock:
        outcome: psycopg.Connection[Any] | BaseException | None = box.get("result")
        if outcome is None:
            box["abandoned"] = True
    if isinstance(outcome, BaseException):
        raise outcome
    if outcome is not None:
        return outcome
    raise NoAnswer(
        f"pglock: opening a connection took longer than the {left:.2f} s left (it goes on in "
        "the background)", sent=False,
    )

