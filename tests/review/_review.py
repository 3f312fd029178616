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
        except BaseException as exc:  # noqa: BLE001 - reported to the test
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
