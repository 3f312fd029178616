"""TTL leases: :class:`Lease` (a row per name in the pglock schema, with a fencing token) and
its factory :func:`lease`. The design is in docs/how-it-works.md, "Leases and semaphores"."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from enum import Enum
from typing import Any, TypedDict

from . import _base, _claims, _lease_rows, _ttl, _waiting
from ._claims import default_holder
from ._classify import Deferred
from ._contract import DEFAULT_SCHEMA, lease_channel, validate_schema
from ._deadline import NoAnswer
from ._keys import remaining, validate_flag, validate_name, validate_timeout
from ._lease_rows import Grant, LeaseInfo, fence, lease_info, list_leases, make_source, renew_many
from ._lease_rows import run as _run
from ._source import ANSWER_GRACE, WAIT_CHUNK, Source, short_deadline
from ._validate import MAX_METADATA_BYTES, encode_metadata, validate_holder, validate_ttl
from .errors import HolderInUse, LockLost, LockNotAcquired

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

logger = logging.getLogger("pglock.lease")

#: Wake this much after the holder's expiry, so the server sees it expired.
_EXPIRY_MARGIN = 0.002
#: A waiter queued in the database (revision 0004) that has not been heard from for this long
#: is skipped; it sends its heartbeat (``wait_v4``) every ``HEARTBEAT`` seconds. A dead head
#: stalls the queue at most about LIVENESS + handoff window + HEARTBEAT after a release.
LIVENESS = 1.0
HEARTBEAT = LIVENESS / 3


class State(Enum):
    """Where a lease handle is: never acquired (or given up), held, known lost, released."""

    NEW = "new"
    HELD = "held"
    LOST = "lost"
    RELEASED = "released"


_NEW, _HELD, _LOST, _RELEASED = State.NEW, State.HELD, State.LOST, State.RELEASED


#: Close what pglock opened for leases and semaphores (:func:`_ttl.shutdown`).
shutdown = _ttl.shutdown


class Lease(_base.BaseLock, _ttl.Held):
    """A TTL lease on a name, with a fencing token; see :func:`lease` and docs/leases.md.

    Thread safety: a ``Lease`` may be shared between threads (``check()``, ``guard()`` and the
    properties are safe from any thread; ``acquire``/``release``/``extend`` are serialized).

    ``acquire(blocking=True, timeout=<the lease's timeout>) -> bool`` follows the lock contract
    (docs/locks.md). It raises :class:`RuntimeError` when this handle already holds the lease,
    :class:`pglock.errors.HolderInUse` (before any SQL) when another live handle of the process
    has its holder id, and :class:`pglock.LockLost` for ``resume=True`` when no live lease of
    the holder exists.
    """

    _qkey: tuple[Any, ...]  # set by _bind: the name's key in the process's wait queues

    def __init__(
        self, source: object, name: str, *, ttl: float = 30.0, timeout: float | None = None,
        metadata: Any = None, keepalive: bool = True, holder: str | None = None,
        on_lost: Callable[[Lease], object] | None = None, resume: bool = False,
        durable: bool = True, schema: str = DEFAULT_SCHEMA,
    ) -> None:
        self._name = validate_name(name)
        self._ttl = validate_ttl(ttl)
        self._timeout = validate_timeout(timeout)
        self._metadata_json = encode_metadata(metadata)
        self._metadata: Any = json.loads(self._metadata_json) if self._metadata_json else None
        self._keepalive = validate_flag(keepalive, "keepalive")
        self._resume = validate_flag(resume, "resume")
        self._durable = validate_flag(durable, "durable")
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"on_lost must be callable, not {type(on_lost).__name__}")
        self._on_lost = on_lost
        self._schema = validate_schema(schema)
        if resume:
            if holder is None:
                raise ValueError("resume=True needs the holder id of the lease to resume")
            if metadata is not None:
                raise ValueError("resume=True keeps the stored metadata; do not pass metadata")
        self._holder = default_holder() if holder is None else validate_holder(holder)
        self._default_holder, self._pid = holder is None, os.getpid()
        self._deferred: Deferred | None = None
        if isinstance(source, Deferred):  # a Locker's pool: resolved at the first acquire
            self._deferred = source
        else:
            self._bind(make_source(source))

        self._op = threading.Lock()  # acquire / release / extend, one at a time
        self._lock = threading.Lock()  # the fields below
        self._state = _NEW
        self._lost_reason = ""
        self._gen = 0
        self._token: int | None = None
        self._acquired_at: datetime | None = None
        self._expires_at: datetime | None = None
        self._sent_at = 0.0
        self._deadline = -math.inf
        self._refused: tuple[str | None, datetime | None] | None = None  # (holder, until)
        #: Why the last acquire did not grant, when not refused by a holder (LockNotAcquired).
        self._why_not: str | None = None
        #: Another handle took the claim over: a release of this handle sends nothing.
        self._superseded = False
        #: An attempt of the acquisition in progress got no answer: it may have been granted.
        self._unknown = False

    def _bind(self, source: Source) -> None:
        self._source = source
        #: The process's wait queue for the name (see :func:`_ttl.wait`).
        self._qkey = (source.key, self._schema, lease_channel(self._schema), self._name)
        self._group = (source.key, self._schema)
        #: One live handle per (database, schema, name, holder id) in the process.
        self._claim_key = (source.database, self._schema, self._name, self._holder)

    @property
    def name(self) -> str:
        """The lease name."""
        return self._name

    @property
    def holder(self) -> str:
        """This lease's holder id (save it to :meth:`resume <lease>` after a restart)."""
        return self._holder

    @property
    def schema(self) -> str:
        return self._schema

    @property
    def ttl(self) -> float:
        """The TTL in seconds that acquire, extend and the keepalive apply."""
        return self._ttl

    @property
    def token(self) -> int | None:
        """The fencing token of the current grant (None before the first acquire): strictly
        larger for every new grant of the name; kept by extend and re-acquire."""
        return self._token

    @property
    def acquired_at(self) -> datetime | None:
        """When this grant began, on the database clock."""
        return self._acquired_at

    @property
    def expires_at(self) -> datetime | None:
        """When the lease expires unless renewed (as of the last renewal), database clock."""
        return self._expires_at

    @property
    def metadata(self) -> Any:
        """The metadata stored with the lease (decoded JSON), or None."""
        return self._metadata

    @property
    def locked(self) -> bool:
        """True while held and not lost (the client deadline has not passed)."""
        with self._lock:
            held = self._state is _HELD and time.monotonic() < self._deadline
            return held and not self._inherited()

    @property
    def lost(self) -> bool:
        """True when the lease was held and is known lost (or its client deadline passed)."""
        with self._lock:
            return self._lost_now() and not self._inherited()

    def _lost_now(self) -> bool:
        return self._state is _LOST or (self._state is _HELD and time.monotonic() >= self._deadline)

    def _not_inherited(self) -> None:
        if self._state in (_HELD, _LOST) and self._inherited():
            raise _base.forked(f"lease {self._name!r}")

    def __repr__(self) -> str:
        return f"<pglock.Lease {self._name!r} {self._state.value} token={self._token}>"

    def _acquire(self, timeout: float | None) -> bool:
        waits = self._waiters()
        gen = waits.enter()
        try:
            with self._op:
                granted = not waits.closed(gen) and self._acquire_now(
                    timeout, lambda: waits.closed(gen)
                )
        finally:
            waits.leave()
        if granted and waits.closed(gen):
            # close() ran meanwhile: nobody waits for this grant any more (a failed release is
            # logged; the row then ends at its TTL).
            with contextlib.suppress(Exception):
                self.release()
            self._why_not = "close() was called"
            return False
        return granted

    def _acquire_now(self, timeout: float | None, closed: _ttl.Closed) -> bool:
        if self._deferred is not None:  # a Locker's pool: looked up again (a child's own)
            self._bind(make_source(self._deferred.resolve()))
        if self._inherited():  # a forked child holds nothing, nor shares its parent's holder id
            if not self._default_holder:  # (the database would grant it its parent's lease)
                raise _base.forked(f"lease {self._name!r} with holder id {self._holder!r}")
            self._state, self._pid, self._holder = _NEW, os.getpid(), default_holder()
            self._bind(self._source)
        self._forget_lost()
        _claims.claim(self, resume=self._resume, in_use=self._in_use)
        granted = False
        self._unknown = False
        try:
            self._why_not = None
            if self._resume:
                granted = self._do_resume()
            elif timeout == 0:
                granted = self._attempt_once()
            else:
                granted = self._wait_and_acquire(timeout, closed)
            return granted
        finally:
            if not granted:
                if self._unknown and not self._resume:
                    self._abandon()
                _claims.unclaim(self)

    def _forget_lost(self) -> None:
        """Refuse a second acquire of a held handle; a lost one may be taken again."""
        with self._lock:
            state = self._state
            if state is _HELD and time.monotonic() < self._deadline:
                raise RuntimeError(f"this lease handle for {self._name!r} is already held")
        if state in (_HELD, _LOST):
            self._lose("its TTL ran out before a renewal succeeded")
            with self._lock:
                self._state = _NEW

    def _outstanding(self) -> bool:
        return self._state in (_HELD, _LOST) and not self._inherited()

    def _not_acquired(self) -> LockNotAcquired:
        info = self._why_not
        if info is None and self._refused is not None and self._refused[0] is not None:
            info = f"held by {self._refused[0]!r} until {self._refused[1]}"
        return LockNotAcquired.for_names(
            [self._name], timeout=self._timeout, what="lease", busy=None, detail=info
        )

    def _wake(self) -> None:
        _ttl.wake(self._qkey, None)

    def _send(
        self, kind: str, *params: Any, timeout: float | None = None, deadline: float | None = None
    ) -> list[tuple[Any, ...]]:
        """One statement of this lease: (name, holder, *params); a statement that waits for
        nothing is cut off at :func:`short_deadline`."""
        deadline = short_deadline(self._ttl) if deadline is None else deadline
        args = (self._name, self._holder, *params)
        return _run(self._source, kind, self._schema, args, timeout=timeout, deadline=deadline)

    def _in_use(self) -> HolderInUse:
        return HolderInUse(self._name, holder=self._holder, schema=self._schema)

    def _claim_state(self) -> tuple[bool, bool]:
        return not self._lost_now(), self._state is _HELD

    def _attempt(self, wait: float | None, v4: bool = False) -> Grant | None:
        """One acquire statement, the server waiting ``wait`` s at most (None: ``WAIT_CHUNK``):
        its row with send and receive times, or None when cut off at ``wait + ANSWER_GRACE``.
        ``v4``: ``acquire_v4``, which queues the caller unless ``wait`` is 0 (NoQueue: the
        schema has no queue)."""
        wait = WAIT_CHUNK if wait is None else min(wait, WAIT_CHUNK)
        params: tuple[Any, ...] = (self._ttl, self._metadata_json, wait, self._durable)
        sent = time.monotonic()
        try:
            rows = self._send(
                "acquire_v4" if v4 else "acquire", *params, *((LIVENESS,) if v4 else ()),
                timeout=wait or None, deadline=sent + wait + ANSWER_GRACE,
            )
        except NoAnswer as exc:
            self._unknown = self._unknown or exc.sent
            self._why_not = (
                f"the database gave no answer within {wait + ANSWER_GRACE:.2f} s (a grant it "
                "may have made is released, or expires at its TTL)"
            )
            logger.warning("acquiring lease %r: %s: %s", self._name, self._why_not, exc)
            return None
        found = rows[0]
        row = Grant._make((*found[:6], sent, time.monotonic(), found[6] if v4 else None))
        if not row.granted:
            self._refused = (row.holder, row.expires_at)
        return row

    def _attempt_once(self) -> bool:
        try:
            row = self._attempt(0.0, v4=True)  # never queues, never passes a live queue
        except _lease_rows.NoQueue:
            row = self._attempt(0.0)
        if row is None:
            return False
        if row.granted:
            return self._granted(row)
        logger.debug("lease %r is held by %r until %s", self._name, row.holder, row.expires_at)
        return False

    def _granted(self, row: Grant, life: float | None = None) -> bool:
        """Believe a grant for ``life`` seconds (default: the TTL) from ``row.sent``, if its
        answer came before then; else give it back (best effort) and return False. A shorter
        ``life`` (a grant handed over by a release) is renewed early: by the keepalive at half
        of it, or here before returning without one."""
        life = self._ttl if life is None else min(life, self._ttl)
        if row.received >= row.sent + life:
            self._give_back(row.token, row.received - row.sent)
            return False
        with self._lock:
            self._state = _HELD
            self._lost_reason = ""
            self._gen += 1
            self._token = row.token
            self._acquired_at = row.acquired_at
            self._expires_at = row.expires_at
            self._sent_at = row.sent
            self._deadline = row.sent + life
            self._retry_at = row.sent + life / 2 if life < self._ttl else None
        logger.debug("acquired lease %r (token %s)", self._name, row.token)
        _ttl.register(self)
        if life < self._ttl and not self._keepalive:
            return self._stretch()
        return True

    def _stretch(self) -> bool:
        """Renew a grant handed over with a short expiry to the full TTL, once (no keepalive)."""
        with self._lock:
            token, gen, deadline = self._token, self._gen, self._deadline
        sent = time.monotonic()
        try:
            rows = self._send("extend", token, self._ttl, self._durable, deadline=deadline)
        except NoAnswer:
            rows = []
        if rows:
            expires_at = _lease_rows.Renewal._make(rows[0]).expires_at
            self._renewed(gen, sent, self._ttl, expires_at, time.monotonic())
        else:
            self._lose("its handed-over grant could not be renewed in time", gen=gen)
        return self.locked

    def _give_back(self, token: int | None, took: float) -> None:
        """A grant whose answer came after its client deadline: this handle never believes
        it. Release it now (the statement is idempotent per holder) so nobody waits a TTL."""
        self._why_not = (
            f"a grant (token {token}) arrived {took:.3f} s after the acquire was sent, past "
            f"its ttl of {self._ttl:g} s, and was given back"
        )
        logger.info("lease %r: %s", self._name, self._why_not)
        try:
            self._release_rows(token, short_deadline(self._ttl))
        except Exception as exc:
            logger.info(
                "giving back the late grant of lease %r failed (it expires at its TTL): %r",
                self._name, exc,
            )

    def _abandon(self) -> None:
        """The acquisition gives up after a statement whose answer was lost: it may have been
        granted (or handed the lease). Release what this holder holds, best effort and within
        a second, so that the lease does not stay with nobody until its TTL."""
        deadline = time.monotonic() + 1.0
        try:
            rows = _run(self._source, "info", self._schema, (self._name,), deadline=deadline)
            token = next((r[2] for r in rows if r[1] == self._holder), None)
            if token is not None:
                self._release_rows(token, deadline)
                logger.info("lease %r: released a grant (token %s) whose answer was lost",
                            self._name, token)
        except Exception as exc:
            logger.info("lease %r: could not look for a grant whose answer was lost (it ends "
                        "at its TTL): %r", self._name, exc)

    def _release_rows(
        self, token: int | None, deadline: float
    ) -> tuple[list[tuple[Any, ...]], bool]:
        """The release statement (``release_v4`` where the schema has the queue: a waiter of
        this process it hands the lease to is woken at once, before its NOTIFY arrives)."""
        params = (self._name, self._holder, token)
        try:
            found = _lease_rows.run_once_more(
                self._source, "release_v4", self._schema, params, deadline=deadline
            )
        except _lease_rows.NoQueue:
            return _lease_rows.run_once_more(
                self._source, "release", self._schema, params, deadline=deadline
            )
        _, _, holder, *grant = found[0][0]
        if holder is not None:
            _waiting.waiters.hand(self._source, self._schema, self._name, holder,
                                  _waiting.Handed._make(grant))
        return found

    def _wait_and_acquire(self, timeout: float | None, closed: _ttl.Closed) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if _lease_rows.has_queue(self._source, self._schema):
            try:
                return self._wait_in_queue(deadline, closed)
            except _lease_rows.NoQueue:
                pass  # revision 0004 is not installed: wait the 0001 way
        return _ttl.wait(
            _lease_rows.LEASES, self._source, self._schema, self._name, None, deadline,
            self._try_once, self._local_wake, closed,
        ) is not None

    def _wait_in_queue(self, deadline: float | None, closed: _ttl.Closed) -> bool:
        """Queue in the database (``acquire_v4``) and wait there for a grant handed over by a
        release or a takeover, heartbeating; queue again at the tail if skipped as dead."""
        _waiting.listen(_lease_rows.LEASES, self._source, self._schema, deadline)
        slot = _waiting.waiters.expect(self._qkey, self._holder, self._source.database)
        try:
            while not closed():
                row = self._attempt(remaining(deadline), v4=True)
                if row is None:
                    return False
                if row.granted and self._granted(row):
                    return True
                if row.waiter is not None:
                    _waiting.waiters.line_up(self._qkey, slot)
                    outcome = self._in_queue(slot, row.waiter, row.sent, deadline, closed)
                    if outcome is not None:
                        return outcome
                elif deadline is not None and time.monotonic() >= deadline:
                    return False
                elif not row.granted:
                    time.sleep(random.uniform(0.001, 0.005))  # raced with a grant: look again
            return False
        finally:
            _waiting.waiters.unexpect(self._qkey, self._holder)

    def _in_queue(
        self, slot: _waiting.Slot, waiter: int, seen: float, deadline: float | None,
        closed: _ttl.Closed,
    ) -> bool | None:
        """Wait as queued ``waiter`` (last seen waiting by a statement sent at ``seen``): True
        granted, False given up (timeout, close()), None skipped (queue again). At the
        deadline it looks once more: a grant handed to it by then (its NOTIFY unheard: the
        listener down, or this process paused) is its own, not passed on by the leave."""
        slot_wait = _waiting.waiters.await_grant
        beat = seen + HEARTBEAT
        while True:
            until = beat if deadline is None else min(beat, deadline)
            handed = slot_wait(slot, waiter, until, closed)
            if handed is not None:
                # Granted after the last statement that saw it waiting: believed from then.
                life = (handed.expires_at - handed.acquired_at).total_seconds()
                row = Grant(True, self._holder, handed.token, handed.acquired_at,
                            handed.expires_at, None, seen, time.monotonic())
                return True if self._granted(row, life) else None
            if closed():
                return self._gave_up("", waiter)
            sent = time.monotonic()
            last = deadline is not None and sent >= deadline
            try:
                rows = self._send("wait_v4", waiter, LIVENESS, deadline=sent + LIVENESS)
            except NoAnswer as exc:
                if last:  # silent: its place lapses in LIVENESS, a grant in its window
                    self._unknown = self._unknown or exc.sent
                    return self._gave_up("its last look got no answer", waiter=None)
                beat = time.monotonic()  # silent: it may be skipped; the next beat tells
                continue
            state, _, token, acquired_at, expires_at, server_time = rows[0]
            if state == "waiting" and last:
                return self._gave_up("", waiter)
            if state == "waiting":
                seen, beat = sent, sent + HEARTBEAT
                continue
            if state != "granted":
                return False if last else None
            life = (expires_at - server_time).total_seconds()
            row = Grant(True, self._holder, token, acquired_at, expires_at, server_time, sent,
                        time.monotonic())
            return True if self._granted(row, life) else None

    def _gave_up(self, why: str, waiter: int | None) -> bool:
        """Leave the queue (best effort: a waiter that says nothing is skipped anyway); False.
        A grant handed to it since its last look is passed on by ``leave_v4`` or, when the
        leave fails, ends at its provisional expiry: ``_why_not`` then says the outcome is
        open (a handle that returns False held it a moment)."""
        try:
            left = waiter is not None and self._send("leave_v4", waiter)[0][0]
        except Exception as exc:
            why, left = f"leaving the wait queue failed ({exc!r})", False
        if not left:
            self._why_not = (
                f"{why or 'it was no longer queued'} as it gave up: a grant handed to it then "
                "was passed on, or ends at its provisional expiry"
            )
            logger.info("lease %r: %s", self._name, self._why_not)
        return False

    def _try_once(self, wait: float | None) -> _ttl.Attempt:
        row = self._attempt(wait)
        if row is not None and row.granted and self._granted(row):
            return True, False, None
        return None, row is not None and not row.granted, self._wake_after(row)

    def _local_wake(self, local: Lease | None) -> float | None:
        """When to look again while a lease of this process holds the name (None: now)."""
        if local is None or local is self:
            return None
        with local._lock:
            if local._state is _HELD:
                return local._deadline + _EXPIRY_MARGIN
            if local._state is _RELEASED:
                # Its release is in flight; its end wakes us (a short safety net).
                return time.monotonic() + 1.0
        return None

    @staticmethod
    def _wake_after(row: Grant | None) -> float:
        """When to try again after an attempt that did not grant: just after the holder's
        expiry on the server clock, or after a short jittered pause."""
        if row is not None and not row.granted and row.expires_at and row.server_time:
            left = max(0.0, float((row.expires_at - row.server_time).total_seconds()))
            return row.received + left + _EXPIRY_MARGIN
        return time.monotonic() + random.uniform(0.005, 0.02)

    def _do_resume(self) -> bool:
        sent = time.monotonic()
        try:
            rows = self._send("extend", None, self._ttl, self._durable)
        except NoAnswer as exc:
            self._why_not = "the database gave no answer to the resume in time"
            logger.warning("resuming lease %r: %s: %s", self._name, self._why_not, exc)
            return False
        received = time.monotonic()
        if not rows:
            raise LockLost(
                self._name,
                reason=f"cannot resume: no live lease is held by {self._holder!r} (it expired, "
                "was released, or another holder has it)",
            )
        token, acquired_at, expires_at, metadata = _lease_rows.Renewal._make(rows[0])
        if received >= sent + self._ttl:
            # Not believed, and not given back either: a later resume can still re-attach.
            self._why_not = "the resume's answer arrived after its ttl had run out"
            logger.info("lease %r: %s", self._name, self._why_not)
            return False
        self._metadata = metadata
        grant = Grant(True, self._holder, token, acquired_at, expires_at, None, sent, received)
        self._granted(grant)
        logger.info("resumed lease %r (token %s)", self._name, token)
        return True

    def release(self) -> None:
        """Release the lease (one statement); waiting holders wake at once.

        :raises RuntimeError: the handle does not hold the lease.
        :raises pglock.LockLost: the lease had expired or been taken over before the release
            (the handle is released all the same), or another handle of this process took it
            over with ``resume=True`` (nothing is sent: the lease is that handle's now).
        :raises psycopg.OperationalError: the release got no answer in time (the lease ends at
            its TTL).
        :raises RuntimeError: in a forked child, of the parent's lease (nothing is sent).
        """
        self._not_inherited()
        with self._op:
            with _claims.lock, self._lock:
                if self._state not in (_HELD, _LOST):
                    raise RuntimeError(f"release of a lease that is not held: {self._name!r}")
                was_lost, reason = self._state is _LOST, self._lost_reason
                self._state = _RELEASED
                self._gen += 1
                token = self._token
                superseded = self._superseded
            if superseded:
                _ttl.unregister(self)
                reason = reason or "another handle of this process took it over"
                raise LockLost(self._name, reason=reason)
            try:
                rows, again = self._release_rows(token, short_deadline(self._ttl))
            except BaseException:
                _ttl.unregister(self)
                logger.warning(
                    "could not release lease %r; it stays until it expires", self._name,
                    exc_info=True,
                )
                raise
            finally:
                _claims.unclaim(self)
            status, notified = rows[0][:2]  # 'released', 'expired' or 'not_held'; NOTIFY sent
            _ttl.unregister(self, notified=bool(notified))
            if status == "released":
                logger.debug("released lease %r (token %s)", self._name, token)
                return
            if status == "expired":
                reason = "it had expired before the release"
            elif again:
                # The first attempt may have deleted the row before its connection died.
                reason = (
                    "the release was sent again after its connection was lost, and the lease "
                    "was not held any more: the first attempt may have released it, or it "
                    "had expired and been taken over"
                )
            elif not was_lost:
                reason = "it was no longer held by this holder (expired and taken over)"
            raise LockLost(self._name, reason=reason)

    def check(self) -> None:
        """Raise :class:`pglock.LockLost` if the lease is lost or its deadline has passed. No
        SQL (the client's own knowledge): cheap enough to call in a loop.

        :raises RuntimeError: the lease is not held (never acquired, or released; in a forked
            child, the parent's lease).
        """
        self._not_inherited()
        with self._lock:
            state, reason, deadline = self._state, self._lost_reason, self._deadline
        if state not in (_HELD, _LOST):
            raise RuntimeError(f"lease {self._name!r} is not held")
        if state is _LOST:
            raise LockLost(self._name, reason=reason)
        if time.monotonic() >= deadline:
            self._lose("its TTL ran out before a renewal succeeded")
            with self._lock:
                reason = self._lost_reason
            raise LockLost(self._name, reason=reason)

    def extend(self, ttl: float | None = None) -> None:
        """Renew the lease now for ``ttl`` seconds (default: the lease's TTL); keeps the token.

        A new ``ttl`` becomes the lease's TTL for the keepalive too. The expiry never moves
        back: extending by less than what is left keeps the later expiry.

        :raises pglock.LockLost: the lease is lost, expired, or no longer held.
        :raises RuntimeError: the lease is not held.
        """
        new_ttl = self._ttl if ttl is None else validate_ttl(ttl)
        with self._op:
            self.check()
            with self._lock:
                token, gen, deadline = self._token, self._gen, self._deadline
            sent = time.monotonic()
            try:
                # An answer after the current deadline could not bring the lease back.
                rows = self._send(
                    "extend", token, new_ttl, self._durable, deadline=max(deadline, sent + 0.05)
                )
            except NoAnswer:
                self._lose("extend got no answer before the lease's client deadline", gen=gen)
                self.check()
                raise
            received = time.monotonic()
            if not rows:
                self._lose("extend found it no longer held (expired or taken over)", gen=gen)
                self.check()
            with self._lock:
                self._ttl = new_ttl
            expires_at = _lease_rows.Renewal._make(rows[0]).expires_at
            self._renewed(gen, sent, new_ttl, expires_at, received)
            # Lost meanwhile (the keepalive's deadline, a late answer): never return as renewed.
            self.check()

    def guard(self, conn: object) -> None:
        """Fence a write: in the caller's open transaction on the lease's database, check that
        this holder still holds the lease with this token, unexpired, and lock the lease row
        until that transaction ends (docs/leases.md, "Fencing with guard()").

        :param conn: a psycopg ``Connection`` (a non-autocommit one begins its transaction
            here), or a SQLAlchemy ``Connection``/ORM ``Session`` on the psycopg driver.
        :raises pglock.LockLost: not held any more: roll the transaction back.
        :raises pglock.InvalidConnectionState: an autocommit connection outside a transaction
            (the lock would end at once), or a failed transaction.

        Example::

            with conn.transaction():
                lease.guard(conn)
                conn.execute("UPDATE accounts SET ... WHERE id = 1")
        """
        self.check()
        with self._lock:
            token, gen = self._token, self._gen
        if not fence(conn, self._source, self._schema, self._name, self._holder, token, self._ttl):
            self._lose("guard found it no longer held (expired or taken over)", gen=gen)
            self.check()
            raise LockLost(self._name, reason="guard found it no longer held")

    def _live(self) -> bool:
        return self._state is _HELD

    def _due(self) -> _lease_rows.Due | None:
        with self._lock:
            if self._state is not _HELD or self._token is None:
                return None
            return _lease_rows.Due(self._name, self._holder, self._token, self._ttl, self._gen,
                                   self._deadline, self._durable)

    def _renewed(
        self, gen: int, sent: float, ttl: float, expires_at: datetime, received: float
    ) -> None:
        """A renewal of grant ``gen`` answered: :meth:`_advance`, and the later expiry kept."""
        with self._lock:
            if gen != self._gen or self._state is not _HELD:
                return
            late = not self._advance(sent, ttl, received)
            if not late and (self._expires_at is None or expires_at > self._expires_at):
                self._expires_at = expires_at
        if late:
            self._lose("a renewal's answer arrived after the lease's client deadline", gen=gen)

    @classmethod
    def _renew_batch(cls, leases: list[Lease]) -> None:
        held = [(lease, due) for lease in leases if (due := lease._due()) is not None]
        if not held:
            return
        sent = time.monotonic()
        try:
            renewed = renew_many(leases[0]._source, leases[0]._schema, [d for _, d in held], sent)
        except Exception as exc:
            logger.info("renewing %d lease(s) failed, retrying: %r", len(held), exc)
            for lease, _ in held:
                lease._renew_failed(sent)
            return
        received = time.monotonic()
        for lease, due in held:
            expires_at = renewed.get((due.name, due.token))
            if expires_at is not None:
                lease._renewed(due.gen, sent, due.ttl, expires_at, received)
            else:
                lease._lose(
                    "the renewal found it no longer held (expired, taken over, or released "
                    "elsewhere)", gen=due.gen,
                )

    def _lose(self, reason: str, gen: int | None = None) -> None:
        with self._lock:
            if self._state is not _HELD or (gen is not None and gen != self._gen):
                return
            self._state = _LOST
            self._lost_reason = reason
        _ttl.unregister(self)
        if self._keepalive:
            logger.warning("lease %r (token %s) was lost: %s", self._name, self._token, reason)
        else:
            logger.info("lease %r (token %s) ended: %s", self._name, self._token, reason)
        on_lost = self._on_lost
        if on_lost is not None:
            _ttl.call_soon(lambda: self._call(on_lost))

    def _call(self, on_lost: Callable[[Lease], object]) -> None:
        try:
            on_lost(self)
        except BaseException:  # SystemExit, CancelledError: pglock's thread goes on
            logger.exception("the on_lost callback of lease %r raised", self._name)


class LeaseOptions(TypedDict, total=False):
    """The options of :func:`lease` and ``Locker.lease`` (one definition for both)."""

    ttl: float
    timeout: float | None
    metadata: Any
    keepalive: bool
    holder: str | None
    on_lost: Callable[[Lease], object] | None
    resume: bool
    durable: bool


def lease(
    source: object, name: str, *, schema: str = DEFAULT_SCHEMA, **options: Unpack[LeaseOptions]
) -> Lease:
    """A TTL lease on ``name`` with a fencing token, as a context manager (docs/leases.md).

    :param source: a ``psycopg_pool.ConnectionPool``, a SQLAlchemy ``Engine`` (psycopg driver)
        or a DSN string; lease statements run on connections of their own from it, never in
        the caller's transaction.
    :param schema: the pglock schema (default ``pglock``).
    :param options: keyword-only, the same for ``Locker.lease`` (``LeaseOptions``):

        * ``ttl`` (default 30): seconds the lease lives without renewal (``0 < ttl <= 86400``);
        * ``timeout`` (default None): ``None`` waits until granted, ``0`` tries once;
        * ``metadata`` (default None): any JSON value stored with the lease (at most 64 KiB);
        * ``keepalive`` (default True): renew in pglock's background thread at about ``ttl/3``;
        * ``holder`` (default: ``host:pid:random``, unique per handle): the holder id; the same
          holder re-acquiring a live lease keeps its token. One handle per holder id and lease
          in a process: a second one's acquire raises :class:`pglock.errors.HolderInUse`;
        * ``on_lost`` (default None): ``on_lost(lease)`` runs in pglock's thread when it is lost;
        * ``resume`` (default False): re-attach to a live lease of ``holder`` instead of
          acquiring; :class:`pglock.LockLost` if there is none;
        * ``durable`` (default True): False commits grants and renewals with
          ``synchronous_commit = off`` (a server crash can forget the last grants).
    :raises TypeError, ValueError: bad arguments, before any SQL.

    Example::

        with pglock.lease(pool, "job:123", ttl=30, timeout=10) as lease:
            with conn.transaction():
                lease.guard(conn)
                conn.execute("UPDATE jobs SET state = 'done' WHERE id = 123")
    """
    return Lease(source, name, schema=schema, **options)


__all__ = ["MAX_METADATA_BYTES", "Lease", "LeaseInfo", "lease", "lease_info", "list_leases"]
