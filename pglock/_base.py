"""The shape every pglock lock shares: docs/locks.md, "The lock contract"."""

from __future__ import annotations

import abc
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ._keys import DEFAULT, validate_flag, validate_timeout
from ._tracked import Tracked
from .errors import LockNotAcquired

logger = logging.getLogger("pglock")


def wait_for(blocking: object, timeout: object, default: float | None) -> float | None:
    """The seconds an ``acquire(blocking, timeout)`` may wait: ``None`` forever, ``0`` once.
    ``timeout`` omitted (:data:`DEFAULT`) is the lock's ``default``; like ``threading``, a
    non-blocking acquire with an explicit timeout other than ``None`` or ``0`` is refused."""
    validate_flag(blocking, "blocking")
    explicit = timeout is not DEFAULT
    value = validate_timeout(timeout) if explicit else default
    if blocking:
        return value
    if explicit and value not in (None, 0):
        raise ValueError("can't specify a timeout for a non-blocking acquire")
    return 0.0


def release_after(release: Callable[[], None], exc: BaseException | None, what: object) -> None:
    """Release at the end of a ``with`` block, never masking the block's own exception: when
    the block raised, a failed release is logged (WARNING) instead of replacing it."""
    if exc is None:
        release()
        return
    try:
        release()
    except Exception:
        logger.warning("releasing %s after the block raised %r failed", what, exc, exc_info=True)


def forked(what: str) -> RuntimeError:
    """In a forked child, the refusal of a release (extend, guard, resign; an acquire under its
    holder id) of ``what`` its parent holds, before anything is sent (docs/locks.md)."""
    return RuntimeError(f"{what} is its parent's, in this forked process ({os.getpid()}): a forked "
                        "child never releases, renews or uses its parent's holds or holder ids")


class Waiters(Tracked):
    """The threads blocked in one lock object's ``acquire()``: a wait loop calls :meth:`enter`
    and asks :meth:`closed` whether ``close()`` ran since, which bumped the generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._count = 0

    def enter(self) -> int:
        with self._lock:
            self._count += 1
            return self._generation

    def leave(self) -> None:
        with self._lock:
            self._count -= 1

    def closed(self, generation: int) -> bool:
        """True when close() ran after the wait that got ``generation`` began."""
        return self._generation != generation

    def _forget_threads(self) -> None:
        self._count = 0

    def close(self) -> bool:
        """Mark every current wait closed; True when at least one thread is waiting."""
        with self._lock:
            self._generation += 1
            return self._count > 0


class BaseLock(Tracked, abc.ABC):
    """What every lock kind shares: timeout rules, the ``with`` block, close() waking waiters.
    A kind implements the abstract methods below; :meth:`_entered` is what ``with`` yields."""

    _timeout: float | None  # the default of acquire(timeout=...), given when the lock was made

    def acquire(self, blocking: bool = True, timeout: float | None = DEFAULT) -> bool:
        """Take the lock; True when held, False when not acquired in time (or close() ran).

        :param blocking: False tries once, whatever the lock's default timeout.
        :param timeout: seconds to wait; ``None`` waits as long as needed, ``0`` tries once;
            omitted, the timeout the lock was made with.
        """
        return self._acquire(wait_for(blocking, timeout, self._timeout))

    @abc.abstractmethod
    def _acquire(self, timeout: float | None) -> bool: ...

    @abc.abstractmethod
    def release(self) -> None: ...

    @property
    @abc.abstractmethod
    def locked(self) -> bool: ...

    @abc.abstractmethod
    def _outstanding(self) -> bool:
        """An acquisition by this object (this thread, where handles are per thread) that was
        not released yet, held or lost."""

    @abc.abstractmethod
    def _not_acquired(self) -> LockNotAcquired: ...

    @abc.abstractmethod
    def _wake(self) -> None:
        """Interrupt this object's waits now (close() has marked them closed)."""

    def _entered(self) -> Any:
        return self

    def close(self) -> None:
        """Wake every thread blocked in this object's :meth:`acquire` at once: it returns
        False (a ``with`` raises :class:`pglock.LockNotAcquired`) with nothing held. What is
        already held stays held; the object may be used again afterwards."""
        if self._waiters().close():
            self._wake()

    def _waiters(self) -> Waiters:
        waiters: Waiters | None = self.__dict__.get("_waiters_")
        if waiters is None:
            waiters = self.__dict__.setdefault("_waiters_", Waiters())
        return waiters

    def __enter__(self) -> Any:
        before = self._outstanding()
        try:
            ok = self.acquire()
        except BaseException:
            if not before and self._outstanding():  # interrupted right after the grant
                self.release()
            raise
        if not ok:
            raise self._not_acquired()
        return self._entered()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        # After an explicit release() inside the block there is nothing left to release.
        if self._outstanding():
            release_after(self.release, exc, self)  # %s of a lock object: its repr
