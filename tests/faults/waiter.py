"""A waiter in a thread of the test process: blocks on a lock and notes when it got it."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

import pglock


class Waiter:
    """Acquire ``name`` of ``kind`` ("session" or "xact") on ``conn`` in a thread.

    For "xact" the waiter opens a transaction and keeps it (and the lock) until :meth:`release`.
    """

    def __init__(
        self, conn: psycopg.Connection[Any], name: str, kind: str = "session", timeout: float = 30
    ) -> None:
        self.conn = conn
        self.name = name
        self.kind = kind
        self.timeout = timeout
        self.acquired_at: float | None = None
        self.error: BaseException | None = None
        self.lock: pglock.PgLock | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.kind == "xact":
                self.conn.execute("BEGIN")
                pglock.xact_lock(self.conn, self.name, timeout=self.timeout)
            else:
                self.lock = pglock.pg_lock(self.conn, self.name, timeout=self.timeout)
                if not self.lock.acquire():
                    raise pglock.LockNotAcquired(self.name, timeout=self.timeout)
            self.acquired_at = time.monotonic()
        except BaseException as exc:
            self.error = exc

    def join(self, timeout: float = 60) -> float:
        """Wait for the outcome; return the monotonic time the lock was acquired."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the waiter is still waiting"
        if self.error is not None:
            raise self.error
        assert self.acquired_at is not None
        return self.acquired_at

    def release(self) -> None:
        if self.kind == "xact":
            self.conn.execute("COMMIT")
        elif self.lock is not None and self.lock.locked:
            self.lock.release()
