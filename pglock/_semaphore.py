"""Semaphores: :class:`Semaphore` (at most ``limit`` weighted permits held at once across
every process, a row per permit), its :class:`Permit` and the factory :func:`semaphore`."""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from . import _base, _conn, _sql, _ttl, _waiting
from ._classify import Deferred
from ._contract import DEFAULT_SCHEMA, LIMIT_MISMATCH, semaphore_channel, validate_schema
from ._deadline import NoAnswer
from ._keys import DEFAULT, exact, validate_name, validate_timeout
from ._source import ANSWER_GRACE, WAIT_CHUNK, DsnSource, Source, make_source, short_deadline
from ._validate import encode_metadata, validate_ttl
from ._waiting import Attempt
from .errors import LimitMismatch, LockLost, LockNotAcquired

if TYPE_CHECKING:
    from typing_extensions import Self

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

logger = logging.getLogger("pglock.semaphore")

#: The largest limit (and weight) accepted: Postgres ``integer``.
MAX_LIMIT = 2**31 - 1
#: Wake this much after the earliest permit held elsewhere expires.
_EXPIRY_MARGIN = 0.005


class Info(NamedTuple):
    """A ``semaphore_info`` row."""

    name: str
    max_permits: int
    held: int
    holders: Any


#: Semaphores, to the shared TTL-row client. A waiter looks once more when its object's queue
#: first subscribes to the NOTIFY listener (as this client always has).
SEMAPHORES = _ttl.Rows("semaphore", semaphore_channel, look_again_on_subscribe=True)


def _count_arg(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if (value := exact(value)) < 1 or value > MAX_LIMIT:
        raise ValueError(f"{what} must be between 1 and {MAX_LIMIT}, got {value!r}")
    return value


class _Request:
    """One acquisition (issue 14): the holder id that every attempt of it, and every resend of
    an attempt, sends, so that an attempt which committed unseen (its answer lost) is found by
    the next one instead of a second permit being taken; ``unsure`` once an attempt's outcome
    is unknown (its row may exist), so that giving up releases that holder id."""

    __slots__ = ("holder", "unsure")

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self.unsure = False


def _run(
    source: Source, kind: str, schema: str, stmt: sql.Composed, deadline: float | None,
    timeout: float | None = None,
) -> tuple[list[tuple[Any, ...]], bool]:
    """Send one semaphore batch (:func:`_ttl.run`): its rows, and whether it was sent twice.
    Safe: extend, info and release are idempotent; an acquire sent twice after its first
    committed fails on its own holder id's primary key (unique_violation, the whole batch
    rolled back), and :meth:`Semaphore._try` adopts that first grant."""
    try:
        return _ttl.run(SEMAPHORES, source, kind, schema, stmt, timeout=timeout, deadline=deadline)
    except psycopg.Error as exc:
        translated = _conn.translate(exc, _conn.Context(schema=schema))
        if translated is None:
            raise
        raise translated from exc


class Permit(_ttl.Held):
    """Permits held on a semaphore by one acquisition, yielded by ``with sem.hold(...)``;
    :meth:`check` raises :class:`pglock.LockLost` if the keepalive lost them (they expired).

    Thread safety: belongs to the thread that acquired it.
    """

    def __init__(
        self, sem: Semaphore, source: Source, holder: str, permits: int, sent: float
    ) -> None:
        self._sem = sem
        self.holder = holder
        self.permits = permits
        self._lock = sem._lock
        self._source = source
        self._schema = sem._schema
        self._group = (source.key, sem._schema)
        self._ttl = sem._ttl
        self._sent_at = sent
        self._deadline = sent + sem._ttl
        self._lost: str | None = None
        self._released = False

    @property
    def name(self) -> str:
        return self._sem.name

    @property
    def locked(self) -> bool:
        """True while held and, as far as this process knows, not lost."""
        return self._live() and time.monotonic() < self._deadline

    def check(self) -> None:
        """:raises pglock.LockLost: the permits are no longer held (expired, or released).
        :raises RuntimeError: in a forked child, of the parent's permits."""
        if self._inherited():
            raise _base.forked(f"a permit of semaphore {self.name!r}")
        if self._released:
            raise LockLost(self.name, reason="the permit was released")
        if self._lost is not None:
            raise LockLost(self.name, reason=self._lost)
        if time.monotonic() >= self._deadline:
            raise LockLost(self.name, reason="its TTL ran out before a renewal succeeded")

    def release(self) -> None:
        """Give the permits back. :raises pglock.LockLost: they had expired meanwhile.
        :raises RuntimeError: in a forked child, of the parent's permits (nothing is sent)."""
        self._sem._release_permit(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if not self._released and not self._inherited():
            _base.release_after(self.release, exc, f"semaphore {self.name!r}")

    def __repr__(self) -> str:
        state = "held" if self.locked else ("released" if self._released else "lost")
        return f"<pglock.Permit {self.name!r} permits={self.permits} {state}>"

    def _live(self) -> bool:
        return not self._released and self._lost is None and not self._inherited()

    def _lose(self, reason: str) -> None:
        with self._lock:
            if not self._live():
                return
            self._lost = reason
        _ttl.unregister(self)
        logger.warning("semaphore %r: permit lost: %s", self.name, reason)

    @classmethod
    def _renew_batch(cls, permits: list[Permit]) -> None:
        live = [p for p in permits if p._live()]
        if not live:
            return
        source, schema = live[0]._source, live[0]._schema
        by_name: dict[tuple[str, float], list[str]] = {}
        for p in live:
            by_name.setdefault((p.name, p._ttl), []).append(p.holder)
        stmt = _sql.semaphore_extend(
            schema, [(name, holders, ttl) for (name, ttl), holders in sorted(by_name.items())]
        )
        sent = time.monotonic()
        # An answer after the earliest deadline would come too late for that permit.
        wait = max(0.05, min(p._deadline for p in live) - sent)
        try:
            rows = _run(source, "extend", schema, stmt, sent + wait, timeout=wait)[0]
        except Exception as exc:
            logger.info("renewing %d semaphore permit(s) failed, retrying: %r", len(live), exc)
            for p in live:
                p._renew_failed(sent)
            return
        received = time.monotonic()
        renewed = {r[0] for r in rows}  # holder ids are unique per acquisition
        for p in live:
            p._renewed(p.holder in renewed, sent, received)

    def _renewed(self, renewed: bool, sent: float, received: float) -> None:
        """Apply a renewal's answer: a permit renewed moves on (:meth:`_advance`), else is lost."""
        with self._lock:
            if not self._live():
                return
            if not renewed:
                reason = "the renewal found it expired (its holder paused too long)"
            elif self._advance(sent, self._ttl, received):
                return
            else:
                reason = "a renewal's answer arrived after the permit's client deadline"
        self._lose(reason)


class _Hold:
    """``sem.hold(permits, timeout)``: acquires at ``with`` and yields the :class:`Permit`."""

    def __init__(self, sem: Semaphore, permits: int, timeout: float | None) -> None:
        self._sem = sem
        self._permits = permits
        self._timeout = timeout
        self._permit: Permit | None = None

    def __enter__(self) -> Permit:
        if self._permit is not None:
            raise RuntimeError("this hold() is already in use; create one per with-block")
        permit = self._sem._take(self._permits, self._timeout)
        if permit is None:
            raise _not_acquired(self._sem.name, self._permits, self._timeout)
        self._permit = permit
        return permit

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        permit, self._permit = self._permit, None
        if permit is not None:
            permit.__exit__(exc_type, exc, tb)


def _not_acquired(name: str, permits: int, timeout: float | None) -> LockNotAcquired:
    what = f"{permits} permit(s) of semaphore"
    return LockNotAcquired.for_names([name], timeout=timeout, what=what, busy="all taken")


class Semaphore(_base.BaseLock):
    """A counting semaphore with weighted permits, shared by every process using the database
    (made by :func:`pglock.semaphore`, which describes the limit and the TTL).

    * ``with sem:`` takes one permit; ``acquire(blocking=True, timeout=DEFAULT, permits=1)``
      and ``release()`` work like :class:`threading.Semaphore`; ``locked`` is True while the
      calling thread holds a permit taken with ``acquire()``;
    * ``with sem.hold(permits=2, timeout=5) as permit:`` takes two and yields a :class:`Permit`;
    * ``sem.count()`` is the number of live permits held now (one query);
    * ``sem.close()`` wakes the threads waiting in ``acquire()`` or ``hold()``.

    Needs the pglock schema (``pglock install``). Thread safety: a Semaphore may be shared by
    threads; waiters of one Semaphore object are served in arrival order.
    """

    def __init__(
        self, source: object, name: str, limit: int, *, ttl: float = 30.0,
        schema: str = DEFAULT_SCHEMA, metadata: Any = None, timeout: float | None = None,
    ) -> None:
        self._name = validate_name(name)
        self._limit = _count_arg(limit, "limit")
        self._ttl = validate_ttl(ttl, hint="permits are renewed while held")
        self._schema = validate_schema(schema)
        self._metadata = encode_metadata(metadata)
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the fields below and those of its permits
        self._held: dict[str, Permit] = {}
        self._by_thread: dict[threading.Thread, list[Permit]] = {}
        self._rng = random.Random()
        self._timeout = validate_timeout(timeout)
        if isinstance(source, Deferred):  # a Locker's pool: resolved at the first use
            self._get_source: Callable[[], object] = source.resolve
            self._source: Source | None = None
        else:
            self._get_source = lambda: source
            self._source = make_source(source, "semaphore")

    @property
    def name(self) -> str:
        return self._name

    @property
    def limit(self) -> int:
        """The limit this object was created with (and that the database must store)."""
        return self._limit

    @property
    def ttl(self) -> float:
        return self._ttl

    def count(self) -> int:
        """The number of live permits held now, by every holder (one query; 0 if never used).

        :raises pglock.SchemaNotInstalled: the pglock schema is missing.
        """
        info = self._info(self._src())
        return 0 if info is None else int(info.held)

    def _info(self, source: Source) -> Info | None:
        stmt = _sql.semaphore_info(self._schema, self._name)
        rows = _run(source, "info", self._schema, stmt, short_deadline(self._ttl))[0]
        return Info._make(rows[0]) if rows else None

    @property
    def locked(self) -> bool:
        """True while the calling thread holds a permit taken with :meth:`acquire` on this
        object, not known lost. No SQL."""
        with self._lock:
            stack = self._by_thread.get(threading.current_thread(), ())
            return any(p.locked for p in stack)

    def __repr__(self) -> str:
        with self._lock:
            mine = sum(p.permits for p in self._held.values())
        return f"<pglock.Semaphore {self._name!r} limit={self._limit} held_here={mine}>"

    def _src(self) -> Source:
        if self._source is None or self._pid != os.getpid():  # a Locker's: the child's own pool
            self._source, self._pid = make_source(self._get_source(), "semaphore"), os.getpid()
        return self._source

    def _wait_key(self, source: Source) -> tuple[Any, ...]:
        """Where this object's waiters queue (see :func:`_ttl.wait`; the owner is ``self``)."""
        return (source.key, self._schema, semaphore_channel(self._schema), self._name)

    def close(self) -> None:
        """Wake the threads blocked in :meth:`acquire` or ``hold()`` (they get False, or
        :class:`pglock.LockNotAcquired`, with nothing held), and close the LISTEN connection
        and a DSN source's connections if nobody else uses them. Optional (they close on their
        own, or at exit); permits held stay held, and using the semaphore reopens what it needs.
        """
        super().close()
        src = self._source
        if src is None:
            return
        _waiting.waiters.retire(self._wait_key(src)[:3])
        if isinstance(src, DsnSource):
            src.close()

    def acquire(
        self, blocking: bool = True, timeout: float | None = DEFAULT, permits: int = 1
    ) -> bool:
        """Take ``permits`` permits; True when taken, False when not within ``timeout`` (or
        when close() ran meanwhile), like :meth:`threading.Semaphore.acquire`.

        :param blocking: False tries once.
        :param timeout: ``None`` waits as long as needed (the default); ``0`` tries once.
        :raises TypeError: ``blocking`` is not a bool (``permits`` is a keyword argument).
        :raises ValueError: ``permits`` is not between 1 and the limit.
        :raises pglock.LimitMismatch: the database stores another limit for this name.
        """
        if not isinstance(blocking, bool):
            raise TypeError(
                f"blocking must be True or False, not {type(blocking).__name__}; pass the "
                f"number of permits as acquire(permits={exact(blocking)!r})"
            )
        wait = _base.wait_for(blocking, timeout, self._timeout)
        return self._push(self._take(_count_arg(permits, "permits"), wait))

    def _acquire(self, timeout: float | None) -> bool:
        return self._push(self._take(1, timeout))

    def _push(self, permit: Permit | None) -> bool:
        if permit is None:
            return False
        with self._lock:
            self._by_thread.setdefault(threading.current_thread(), []).append(permit)
        return True

    def _outstanding(self) -> bool:
        with self._lock:
            stack = self._by_thread.get(threading.current_thread(), [])
            return bool(stack) and not stack[-1]._inherited()

    def _not_acquired(self) -> LockNotAcquired:
        return _not_acquired(self._name, 1, self._timeout)

    def _wake(self, *, head: bool = False) -> None:
        src = self._source
        if src is not None:
            _ttl.wake(self._wait_key(src), self, head=head)

    def release(self) -> None:
        """Give back the permits of this thread's latest :meth:`acquire`.

        :raises RuntimeError: this thread holds none through :meth:`acquire`.
        :raises pglock.LockLost: they had expired meanwhile (given back all the same).
        """
        me = threading.current_thread()
        with self._lock:
            stack = self._by_thread.get(me)
            if not stack:
                raise RuntimeError(
                    f"this thread holds no permit of semaphore {self._name!r} taken with "
                    "acquire(); release a Permit from hold() with its own release()"
                )
            permit = stack.pop()
            if not stack:
                del self._by_thread[me]
        permit.release()

    def hold(self, permits: int = 1, timeout: float | None = None) -> _Hold:
        """``with sem.hold(permits=k, timeout=t) as permit:`` takes ``k`` permits for the block.

        :raises pglock.LockNotAcquired: not taken within ``timeout`` (at ``with``), or
            close() ran meanwhile.
        """
        return _Hold(self, _count_arg(permits, "permits"), validate_timeout(timeout))

    def _take(self, permits: int, timeout: float | None) -> Permit | None:
        """One acquisition of ``permits``: the permit, or None (not in time, or closed). Its
        attempts share one holder id (:class:`_Request`); when it ends without a permit after
        an attempt whose outcome is unknown, that holder id is released (:meth:`_abandon`)."""
        if permits > self._limit:
            raise ValueError(
                f"permits={permits} can never be granted by semaphore {self._name!r} "
                f"with limit {self._limit}"
            )
        source = self._src()
        req = _Request(f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}")
        try:
            permit = self._attempts(source, req, permits, timeout)
        except BaseException:
            self._abandon(source, req)
            raise
        if permit is None:
            self._abandon(source, req)
        return permit

    def _attempts(
        self, source: Source, req: _Request, permits: int, timeout: float | None
    ) -> Permit | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if timeout == 0:  # tries once, whoever else of this object waits
            once: Permit | None = self._try(source, req, permits, deadline, wait=False)[0]
            return once
        waits = self._waiters()
        gen = waits.enter()
        try:
            permit: Permit | None = _ttl.wait(
                SEMAPHORES, source, self._schema, self._name, self, deadline,
                lambda _left: self._try(source, req, permits, deadline, wait=True),
                closed=lambda: waits.closed(gen),
            )
        finally:
            waits.leave()
        if permit is not None and waits.closed(gen):
            try:  # a grant nobody waits for
                permit.release()
            except Exception:
                req.unsure = True  # released by _abandon, or it ends at its TTL
            return None
        return permit

    def _try(
        self, source: Source, req: _Request, permits: int, deadline: float | None, *, wait: bool
    ) -> Attempt:
        """One acquire statement for ``req``, cut off at ``deadline`` (or ``WAIT_CHUNK``) plus
        grace: the waiter's attempt (see :func:`_ttl.wait`). Finding ``req``'s own row (an
        earlier attempt, or the first send of this one, committed unseen) adopts it."""
        stmt = _sql.semaphore_acquire(
            self._schema, self._name, self._limit, req.holder, permits, self._ttl,
            self._metadata, wait,
        )
        sent = time.monotonic()
        cut_off = (sent + WAIT_CHUNK if deadline is None else deadline) + ANSWER_GRACE
        try:
            rows, again = _run(source, "acquire", self._schema, stmt, cut_off)
        except NoAnswer as exc:
            req.unsure = req.unsure or exc.sent  # a connect given up sent nothing
            logger.warning(
                "acquiring semaphore %r got no answer in time (a permit it may have been "
                "granted is looked for by the next attempt, or released if it gives up): %s",
                self._name, exc,
            )
            return None, False, time.monotonic() + self._rng.uniform(0.005, 0.02)
        except pg_errors.UniqueViolation:
            # The (semaphore, holder) key: this request's row is there, so an attempt whose
            # answer was lost committed; the failed batch rolled back with no other effect.
            return self._adopt(source, req, permits)
        except psycopg.Error as exc:
            if exc.sqlstate == LIMIT_MISMATCH:
                raise LimitMismatch(
                    self._name, limit=self._limit, stored_limit=self._stored_limit(source)
                ) from exc
            req.unsure = True  # a resend's error, or a lost connection: the first may have run
            raise
        except BaseException:
            req.unsure = True  # interrupted, or translated: the statement may have run
            raise
        received = time.monotonic()
        granted, _max, held, retry_in = rows[0]  # a semaphore_acquire row
        if not granted:
            # A first send that committed unseen counts against this one (it may even be what
            # does not fit): look for this request's row before waiting.
            if again or req.unsure:
                req.unsure = True
                adopted = self._adopt(source, req, permits)
                if adopted[0] is not None:
                    return adopted
            logger.debug("semaphore %r: %d of %d held, %d more do not fit", self._name, held,
                         self._limit, permits)
            again_at = None if retry_in is None else received + float(retry_in) + _EXPIRY_MARGIN
            return None, True, again_at
        if received >= sent + self._ttl:
            self._give_back(source, req, received - sent)
            return None, False, time.monotonic() + self._rng.uniform(0.005, 0.02)
        logger.debug("acquired %d permit(s) of semaphore %r (%d of %d held)", permits,
                     self._name, held, self._limit)
        return self._hold_permit(source, req.holder, permits, sent), False, None

    def _hold_permit(self, source: Source, holder: str, permits: int, sent: float) -> Permit:
        permit = Permit(self, source, holder, permits, sent)
        with self._lock:
            self._held[holder] = permit
        _ttl.register(permit)
        return permit

    def _adopt(self, source: Source, req: _Request, permits: int) -> Attempt:
        """Take over ``req``'s row that an attempt committed unseen: renew it for the TTL
        (``semaphore_extend``, which also says whether it is live) and hold it from the
        renewal's send time. Not found live, or no answer in time: nothing held (yet)."""
        stmt = _sql.semaphore_extend(self._schema, [(self._name, [req.holder], self._ttl)])
        sent = time.monotonic()
        try:
            rows = _run(source, "extend", self._schema, stmt, sent + self._ttl)[0]
        except Exception as exc:
            rows = None
            logger.info("semaphore %r: renewing a grant an earlier attempt may have made "
                        "failed: %r", self._name, exc)
        retry = time.monotonic() + self._rng.uniform(0.005, 0.02)
        if rows is None:
            req.unsure = True
            return None, False, retry
        if not any(r[0] == req.holder for r in rows):
            return None, False, retry
        if time.monotonic() >= sent + self._ttl:
            req.unsure = True
            return None, False, retry
        logger.info(
            "semaphore %r: an attempt whose answer was lost had been granted %d permit(s); "
            "they are held (holder %s)", self._name, permits, req.holder,
        )
        return self._hold_permit(source, req.holder, permits, sent), False, None

    def _give_back(self, source: Source, req: _Request, took: float) -> None:
        """A grant whose answer came after its client deadline (send time + ttl): never
        believed; released now (best effort) so that it does not count until its TTL."""
        logger.info(
            "semaphore %r: a grant arrived %.3f s after the acquire was sent, past its ttl of "
            "%g s, and is given back", self._name, took, self._ttl,
        )
        try:
            stmt = _sql.semaphore_release(self._schema, self._name, req.holder)
            _run(source, "release", self._schema, stmt, short_deadline(self._ttl))
        except Exception as exc:
            req.unsure = True  # the next attempt adopts it, or giving up releases it
            logger.info(
                "giving back the late grant of semaphore %r failed: %r", self._name, exc,
            )

    def _abandon(self, source: Source, req: _Request) -> None:
        """An acquisition that ends without a permit after an attempt of unknown outcome:
        release its holder id (best effort, within ``ANSWER_GRACE``) so that no permit stays
        held by nobody until its TTL. An attempt still running on the server after the client
        gave up on it can commit after this; then it ends at its TTL."""
        if not req.unsure:
            return
        stmt = _sql.semaphore_release(self._schema, self._name, req.holder)
        try:
            rows = _run(source, "release", self._schema, stmt, time.monotonic() + ANSWER_GRACE)[0]
        except Exception as exc:
            logger.info(
                "semaphore %r: releasing holder %s after a failed acquire failed (a permit an "
                "attempt may have been granted ends at its TTL): %r",
                self._name, req.holder, exc,
            )
            return
        status = rows[0][0] if rows else "not_held"
        if status == "not_held":
            logger.debug("semaphore %r: the failed acquire (holder %s) had been granted nothing",
                         self._name, req.holder)
        else:
            logger.info(
                "semaphore %r: a permit granted to a failed acquire whose answer was lost was "
                "released (holder %s, %s)", self._name, req.holder, status,
            )
            self._poke()

    def _stored_limit(self, source: Source) -> int | None:
        try:
            info = self._info(source)
        except psycopg.Error:
            return None
        return None if info is None else int(info.max_permits)

    def _poke(self) -> None:
        """Wake this object's first waiter (a local release: it tries at once)."""
        self._wake(head=True)

    def _release_permit(self, permit: Permit) -> None:
        if permit._inherited():
            raise _base.forked(f"a permit of semaphore {self._name!r}")
        if permit._released:
            raise RuntimeError(f"this permit of semaphore {self._name!r} was already released")
        with self._lock:
            permit._released = True
            self._held.pop(permit.holder, None)
            for stack in self._by_thread.values():
                if permit in stack:
                    stack.remove(permit)
        _ttl.unregister(permit)
        try:
            stmt = _sql.semaphore_release(self._schema, self._name, permit.holder)
            rows, again = _run(
                self._src(), "release", self._schema, stmt, short_deadline(self._ttl)
            )
        finally:
            self._poke()  # local waiters try at once
        status = rows[0][0] if rows else "not_held"
        if status != "released" or permit._lost is not None:
            reason = permit._lost or (
                "it had expired before the release" if status == "expired" else
                # The first attempt may have deleted the row before its connection died.
                "the release was sent again after its connection was lost, and the permit was "
                "not held any more: the first attempt may have released it, or it had expired"
                if again else
                "it was no longer held (expired and taken by others)"
            )
            raise LockLost(self._name, reason=reason)
        logger.debug("released %d permit(s) of semaphore %r", permit.permits, self._name)


class SemaphoreOptions(TypedDict, total=False):
    """The options of :func:`semaphore` and ``Locker.semaphore`` (one definition for both)."""

    ttl: float
    metadata: Any
    timeout: float | None


def semaphore(
    source: object, name: str, limit: int, *, schema: str = DEFAULT_SCHEMA,
    **options: Unpack[SemaphoreOptions],
) -> Semaphore:
    """A semaphore ``name`` allowing ``limit`` permits at once across all processes.

    :param source: a ``psycopg_pool.ConnectionPool``, a SQLAlchemy ``Engine`` (psycopg driver)
        or a DSN string; statements run on connections of their own from it.
    :param limit: the number of permits (stored by the first acquire; every user passes it).
    :param schema: the pglock schema (default ``pglock``).
    :param options: keyword-only, the same for ``Locker.semaphore`` (``SemaphoreOptions``):

        * ``ttl`` (default 30): seconds a holder's permits outlive its last renewal (renewed
          every ``ttl/3`` while held); a crashed holder's permits come back within it;
        * ``metadata`` (default None): a JSON value stored with each permit;
        * ``timeout`` (default None): the default of ``acquire()`` and ``with`` (``None``
          waits as long as needed; ``0`` tries once).
    :raises TypeError, ValueError: bad arguments, before any SQL.

    Example::

        exports = pglock.semaphore(pool, "exports", limit=3)
        with exports:                                   # one permit
            run_export()
        with exports.hold(permits=2, timeout=10):       # a heavy job takes two
            run_big_export()
    """
    return Semaphore(source, name, limit, schema=schema, **options)
