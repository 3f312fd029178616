"""One contract, every lock kind (docs/locks.md): the same tests run over each of them.

A kind is a way to make the lock under test (``make``) and a rival on another session that
conflicts with it (``rival``), both used only through the contract: ``acquire(blocking,
timeout) -> bool``, ``release()``, ``locked``, ``with`` and ``close()``.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from _threads import in_thread
from psycopg_pool import ConnectionPool

import pglock
from pglock._keys import DEFAULT

#: Every grant reported here is checked against the database (tests/_believer.py).
pytestmark = pytest.mark.usefixtures("believer")


class Env:
    """The sources a kind needs, on the test's lease database; all closed after the test."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conns: list[psycopg.Connection[Any]] = []
        self._pool: ConnectionPool[Any] | None = None

    def conn(self) -> psycopg.Connection[Any]:
        c = psycopg.connect(self.dsn, autocommit=True)
        self._conns.append(c)
        return c

    @property
    def pool(self) -> ConnectionPool[Any]:
        if self._pool is None:
            self._pool = ConnectionPool(self.dsn, min_size=1, max_size=4, open=True, timeout=10)
        return self._pool

    def close(self) -> None:
        for c in self._conns:
            with contextlib.suppress(Exception):
                c.close()
        if self._pool is not None:
            self._pool.close()


Make = Callable[[Env, str, Any], Any]


@dataclass(frozen=True)
class Kind:
    id: str
    make: Make  # the lock under test, with this default timeout (DEFAULT: the factory's own)
    rival: Callable[[Env, str], Any]  # a conflicting lock on another session
    counting: bool = False  # a second acquire() on a held object takes another permit


def _kw(timeout: Any) -> dict[str, Any]:
    return {} if timeout is DEFAULT else {"timeout": timeout}


def _advisory_rival(shared: bool = False) -> Callable[[Env, str], Any]:
    return lambda env, name: pglock.pg_lock(env.conn(), name, shared=shared)


KINDS = [
    Kind("pg_lock", lambda env, n, t: pglock.pg_lock(env.conn(), n, **_kw(t)), _advisory_rival()),
    Kind("pool_lock", lambda env, n, t: pglock.pool_lock(env.pool, n, **_kw(t)), _advisory_rival()),
    Kind(
        "lease",
        lambda env, n, t: pglock.lease(env.dsn, n, **_kw(t)),
        lambda env, n: pglock.lease(env.dsn, n),
    ),
    Kind(
        "semaphore",
        lambda env, n, t: pglock.semaphore(env.dsn, n, 1, **_kw(t)),
        lambda env, n: pglock.semaphore(env.dsn, n, 1),
        counting=True,
    ),
    Kind(
        "rwlock-read",
        lambda env, n, t: pglock.rwlock(env.pool, n).read(**_kw(t)),
        _advisory_rival(shared=False),
    ),
    Kind(
        "rwlock-write",
        lambda env, n, t: pglock.rwlock(env.pool, n).write(**_kw(t)),
        _advisory_rival(shared=True),
    ),
    Kind("singleton", lambda env, n, t: pglock.singleton(env.pool, n, **_kw(t)), _advisory_rival()),
]


@pytest.fixture(params=KINDS, ids=[k.id for k in KINDS])
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def env(dsn: str) -> Iterator[Env]:
    e = Env(dsn)
    yield e
    e.close()


@contextlib.contextmanager
def held_by_rival(kind: Kind, env: Env, name: str) -> Iterator[Any]:
    rival = kind.rival(env, name)
    assert rival.acquire(blocking=False) is True
    try:
        yield rival
    finally:
        rival.release()


def free(kind: Kind, env: Env, name: str) -> bool:
    """Whether a rival on another session can take the lock now (and gives it back)."""
    rival = kind.rival(env, name)
    if not rival.acquire(blocking=False):
        return False
    rival.release()
    return True


def test_acquire_release_locked(kind: Kind, env: Env, name: str) -> None:
    lock = kind.make(env, name, DEFAULT)
    assert lock.locked is False
    assert lock.acquire() is True
    assert lock.locked is True
    assert not free(kind, env, name)
    lock.release()
    assert lock.locked is False
    assert free(kind, env, name)


def test_with_holds_for_the_block(kind: Kind, env: Env, name: str) -> None:
    lock = kind.make(env, name, DEFAULT)
    with lock:
        assert lock.locked is True
        assert not free(kind, env, name)
    assert lock.locked is False
    assert free(kind, env, name)


def test_acquire_returns_false_when_held_elsewhere(kind: Kind, env: Env, name: str) -> None:
    lock = kind.make(env, name, DEFAULT)
    with held_by_rival(kind, env, name):
        assert lock.acquire(timeout=0) is False
        assert lock.acquire(timeout=0.2) is False
        assert lock.locked is False
    assert lock.acquire(timeout=0) is True
    lock.release()


def test_with_raises_lock_not_acquired_and_never_runs_the_body(
    kind: Kind, env: Env, name: str
) -> None:
    lock = kind.make(env, name, 0)
    with held_by_rival(kind, env, name):
        with pytest.raises(pglock.LockNotAcquired), lock:
            pytest.fail("the body ran without the lock")
        assert lock.locked is False


def test_blocking_false_tries_once_whatever_the_default_timeout(
    kind: Kind, env: Env, name: str
) -> None:
    lock = kind.make(env, name, 30)
    with held_by_rival(kind, env, name):
        started = time.monotonic()
        assert lock.acquire(blocking=False) is False
        assert lock.acquire(blocking=False, timeout=None) is False  # as threading's -1
        assert lock.acquire(blocking=False, timeout=0) is False
        assert time.monotonic() - started < 20  # it did not wait for the default 30 s
    assert lock.acquire(blocking=False) is True
    lock.release()


def test_blocking_false_with_a_timeout_is_a_value_error(kind: Kind, env: Env, name: str) -> None:
    lock = kind.make(env, name, DEFAULT)
    with pytest.raises(ValueError, match="non-blocking"):
        lock.acquire(blocking=False, timeout=1)
    assert lock.locked is False
    assert free(kind, env, name)


def test_the_timeout_default_reads_well(kind: Kind, env: Env, name: str) -> None:
    lock = kind.make(env, name, DEFAULT)
    default = inspect.signature(lock.acquire).parameters["timeout"].default
    assert default is DEFAULT
    assert repr(default) == "<the lock's timeout>"


def test_release_of_an_unheld_lock_is_a_runtime_error(kind: Kind, env: Env, name: str) -> None:
    lock = kind.make(env, name, DEFAULT)
    with pytest.raises(RuntimeError):
        lock.release()
    assert lock.acquire() is True
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()


def test_exit_after_an_explicit_release_does_nothing_more(
    kind: Kind, env: Env, name: str
) -> None:
    lock = kind.make(env, name, DEFAULT)
    with lock:
        lock.release()
        assert lock.locked is False
        assert free(kind, env, name)
    assert lock.locked is False
    assert free(kind, env, name)


def test_a_second_acquire_on_a_held_object(kind: Kind, env: Env, name: str) -> None:
    lock = kind.make(env, name, DEFAULT)
    assert lock.acquire() is True
    try:
        if kind.counting:
            assert lock.acquire(blocking=False) is False  # limit 1: the one permit is taken
        else:
            with pytest.raises(RuntimeError):
                lock.acquire(blocking=False)
        assert lock.locked is True
    finally:
        lock.release()
    assert free(kind, env, name)


def test_a_second_object_in_the_same_thread_answers_false(
    kind: Kind, env: Env, name: str
) -> None:
    """pals ``test_same_lock_fails_acquire``, ``test_context_manager`` and kazoo
    ``test_lock_non_blocking``: while one object holds the name, another object of the same
    kind in the same thread answers False to a try-once and to a timed attempt (through a
    pool at once: only this thread could release it, docs/pools.md), its ``with`` raises
    LockNotAcquired, and it takes the name once the first lets go."""
    first, second = kind.make(env, name, DEFAULT), kind.make(env, name, 0)
    with first:
        assert second.acquire(blocking=False) is False
        assert second.acquire(timeout=0) is False
        assert second.acquire(timeout=0.2) is False
        with pytest.raises(pglock.LockNotAcquired), second:
            pytest.fail("the body ran without the lock")
        assert second.locked is False and first.locked is True
    assert second.acquire(blocking=False) is True
    second.release()
    assert free(kind, env, name)


def test_the_body_exception_is_not_masked(kind: Kind, env: Env, name: str) -> None:
    lock = kind.make(env, name, DEFAULT)
    with pytest.raises(KeyError, match="from the body"), lock:
        raise KeyError("from the body")
    assert lock.locked is False
    assert free(kind, env, name)


def _waiting(lock: Any, *, use_with: bool) -> Callable[[], object]:
    def wait() -> object:
        if not use_with:
            return lock.acquire()
        with lock:
            return "the body ran"

    return wait


@pytest.mark.parametrize("use_with", [False, True], ids=["acquire", "with"])
def test_close_wakes_a_blocked_waiter_with_nothing_held(
    kind: Kind, env: Env, name: str, use_with: bool
) -> None:
    lock = kind.make(env, name, None)
    with held_by_rival(kind, env, name):
        out: list[object] = []
        waiter = threading.Thread(
            target=lambda: out.append(in_thread(_waiting(lock, use_with=use_with), timeout=60))
        )
        waiter.start()
        time.sleep(0.5)  # let it block (closing earlier must work too; this tests the wait)
        assert waiter.is_alive(), out
        lock.close()
        waiter.join(20)
        assert not waiter.is_alive(), "close() did not wake the waiter"
    if use_with:
        assert isinstance(out[0], pglock.LockNotAcquired), out
    else:
        assert out[0] is False
    assert lock.locked is False
    assert free(kind, env, name)  # the waiter left nothing held, and no late grant
    time.sleep(0.5)
    assert free(kind, env, name)
    # The object can be used again after close().
    assert lock.acquire(timeout=5) is True
    lock.release()
