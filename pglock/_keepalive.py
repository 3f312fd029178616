"""The keepalive: one scheduler thread renewing every grant of the process (:class:`Held`) in
batches, a renewal worker per (source, schema), and the threads that run users' callbacks and
telemetry."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from ._source import Source

logger = logging.getLogger("pglock.ttl")

H = TypeVar("H", bound="Held")
Key = tuple[Any, ...]

#: The keepalive scheduler looks up at least this often (seconds), grants or not.
_KEEPALIVE_TICK = 5.0
#: A renewal worker (one per source and schema) with nothing to do for this long exits.
_WORKER_IDLE = 30.0


class Held:
    """A grant that the keepalive renews (a lease handle, a semaphore permit): a subclass sets
    the fields below (``_lock`` guards them) and implements the three hooks."""

    _lock: threading.Lock
    _source: Source
    _schema: str
    _group: Key  # (source key, schema): its renewal worker
    _ttl: float
    _sent_at: float  # its last successful grant or renewal was sent then (monotonic)
    _deadline: float  # it is believed until then
    _qkey: Key | None = None  # the shared wait queue of the name it holds
    _keepalive = True  # False: nothing renews it (it is lost at its deadline all the same)
    _retry_at: float | None = None  # when to try again after a failed renewal
    _renewing = False  # a renewal of it is in flight (guarded by the keepalive's lock)
    _pid = 0  # the process granted it (_ttl.register); another: not held in this forked child

    def _inherited(self) -> bool:
        return self._pid != os.getpid()

    def _live(self) -> bool:
        """Held and not known lost (read without the lock by the scheduler)."""
        raise NotImplementedError

    def _lose(self, reason: str) -> None:
        """Declare it lost, once: :func:`unregister` it, log, tell the user."""
        raise NotImplementedError

    @classmethod
    def _renew_batch(cls: type[H], items: list[H]) -> None:
        """Renew ``items`` (of this class, one group) in one statement; on a failure,
        :meth:`_renew_failed`."""
        raise NotImplementedError

    def _renew_at(self, divisor: int = 3) -> float:
        """When it is due (at ``ttl/3``); ``divisor=6``: when it may share an earlier round."""
        retry = self._retry_at
        return retry if retry is not None else self._sent_at + self._ttl / divisor

    def _renew_failed(self, sent: float) -> None:
        with self._lock:
            self._retry_at = sent + min(1.0, max(0.05, self._ttl / 10))

    def _advance(self, sent: float, ttl: float, received: float) -> bool:
        """With ``_lock`` held: move the deadline on for a renewal sent at ``sent``, unless its
        answer came after it (False: lost by then; a late answer never brings it back)."""
        if received >= self._deadline:
            return False
        self._sent_at = max(self._sent_at, sent)
        self._deadline = max(self._deadline, sent + ttl)
        self._retry_at = None
        return True


class _Worker:
    """The renewal thread of one (source, schema) and its batches, run one after another."""

    __slots__ = ("batches", "cond", "thread")

    def __init__(self, lock: threading.Lock) -> None:
        self.batches: deque[list[Held]] = deque()
        self.cond = threading.Condition(lock)
        self.thread: threading.Thread | None = None


class _Keepalive:
    """The grants held in the process and their renewal (docs/leases.md, "Keepalive and loss"):
    a scheduler thread that sends nothing (it hands due grants to their group's worker, and
    declares a grant lost at its deadline even while a renewal of it is stuck), and one worker
    thread per (source, schema)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # the scheduler sleeps on it
        self.held: set[Held] = set()
        self.thread: threading.Thread | None = None
        self.next_wake = -math.inf  # when the sleeping scheduler wakes next (-inf: it is awake)
        self.workers: dict[Key, _Worker] = {}  # renewal workers per (source key, schema)

    def register(self, item: Held) -> None:
        with self.lock:
            self.held.add(item)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="pglock-keepalive",
                                               daemon=True)
                self.next_wake = -math.inf
                self.thread.start()
            elif min(item._renew_at(), item._deadline) < self.next_wake:
                # Only when the new grant is due before the thread's next wake-up: a stream of
                # acquires must not make it rescan every held grant each time.
                self.cond.notify()

    def forget(self, item: Held) -> None:
        with self.lock:
            self.held.discard(item)

    def _run(self) -> None:
        while True:
            try:
                self._schedule()
            except Exception:  # a bug here must not stop every renewal in the process
                logger.exception("pglock's keepalive failed; it goes on")
                time.sleep(0.1)

    def _schedule(self) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                lost, batches, wake_at = self._scan(now)
                for group, items in batches.items():
                    self._dispatch(group, items)
                if not lost:
                    if batches:
                        continue  # look again: the grants handed out are no longer due
                    # Look up every few seconds at least: registering a grant due later than that
                    # needs no wake-up (a thread switch per acquire otherwise).
                    self.next_wake = min(wake_at, now + _KEEPALIVE_TICK)
                    self.cond.wait(max(0.0, self.next_wake - now))
                    self.next_wake = -math.inf  # awake: it rescans before sleeping again
                    continue
            for item in lost:
                item._lose("its TTL ran out before a renewal succeeded")

    def _scan(self, now: float) -> tuple[list[Held], dict[Key, list[Held]], float]:
        """With the lock held: the grants past their deadline, the renewal batches due now
        (marked renewing), and when to look again."""
        lost: list[Held] = []
        wake_at = math.inf
        due_groups: set[Key] = set()
        for item in self.held:
            if not item._live():
                continue  # being released, or lost: about to leave the set
            if now >= item._deadline:
                lost.append(item)
                continue
            wake_at = min(wake_at, item._deadline)
            if not item._keepalive or item._renewing:
                continue  # a renewal in flight: only its deadline counts
            due = item._renew_at()
            if now >= due:
                due_groups.add(item._group)
            else:
                wake_at = min(wake_at, due)
        batches: dict[Key, list[Held]] = {}
        for item in self.held if due_groups else ():
            renewable = item._keepalive and item._group in due_groups and not item._renewing
            if renewable and item._live() and item._renew_at(6) <= now < item._deadline:
                item._renewing = True
                batches.setdefault(item._group, []).append(item)
        return lost, batches, wake_at

    def _dispatch(self, group: Key, items: list[Held]) -> None:
        """With the lock held: hand a batch to its group's worker (started if needed)."""
        worker = self.workers.get(group) or self.workers.setdefault(group, _Worker(self.lock))
        worker.batches.append(items)
        if worker.thread is None:
            worker.thread = threading.Thread(target=self._work, args=(group, worker),
                                             name=f"pglock-renewal-{group[1]}", daemon=True)
            worker.thread.start()
        else:
            worker.cond.notify()

    def _work(self, group: Key, worker: _Worker) -> None:
        while True:
            with self.lock:
                while not worker.batches:
                    if not worker.cond.wait(_WORKER_IDLE) and not worker.batches:
                        worker.thread = None
                        if self.workers.get(group) is worker:
                            del self.workers[group]
                        return
                items = worker.batches.popleft()
            kinds: dict[type[Held], list[Held]] = {}
            for item in items:
                kinds.setdefault(type(item), []).append(item)
            try:
                for kind, batch in kinds.items():
                    try:
                        kind._renew_batch(batch)
                    except Exception:  # a bug here must not stop the group's renewals
                        logger.exception("pglock's renewal of %s failed; it goes on", kind)
            finally:
                with self.lock:
                    for item in items:
                        item._renewing = False
                    self.cond.notify()  # the scheduler looks again: due times moved


class _Callbacks:
    """A thread of pglock's running the functions queued for it, in order: the user's callbacks
    (``on_lost``), never in the caller's thread, which may hold a lock the callback takes, nor
    the keepalive's, which must not wait on them; in another one, telemetry (a slow exporter
    delays no lock call, renewal or callback)."""

    def __init__(self, name: str = "pglock-callbacks", bound: float = math.inf,
                 delay: float = 0.0) -> None:
        self.name, self.bound, self.delay = name, bound, delay  # beyond ``bound``: dropped
        self.dropped = 0
        self.urgent = False  # a flush waits: no delay
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.queue: deque[Callable[[], object]] = deque()
        self.thread: threading.Thread | None = None

    def call(self, fn: Callable[[], object], bound: float | None = None) -> int:
        """Queue ``fn``: 0, or when ``bound`` (default the queue's) wait already, the number
        of functions dropped so far, this one included."""
        with self.lock:
            if len(self.queue) >= (self.bound if bound is None else bound):
                self.dropped += 1
                return self.dropped
            self.queue.append(fn)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()
            elif len(self.queue) == 1:
                self.ready.notify()
        return 0

    def flush(self, timeout: float) -> bool:
        """Wait until what was queued before has run (False: not within ``timeout`` s)."""
        done = threading.Event()
        self.call(done.set, math.inf)
        with self.lock:
            self.urgent = True
            self.ready.notify()
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.queue:
                    if not self.ready.wait(_WORKER_IDLE) and not self.queue:
                        self.thread = None
                        return
                    if self.delay and not self.urgent:  # let a batch gather: a thread switch
                        self.ready.wait(self.delay)  # per call costs more than recording it
                self.urgent = False
            while self.queue:
                try:
                    self.queue.popleft()()
                except BaseException:  # SystemExit, CancelledError: later ones must still run
                    logger.exception("a pglock callback raised")


def call_soon(fn: Callable[[], object]) -> None:
    """Run ``fn()`` in pglock's callback thread (its exceptions are logged)."""
    callbacks.call(fn)


#: The process's keepalive, callback and telemetry threads (new ones in a forked child:
#: pglock._fork). Telemetry queues at most 10000 recordings (docs/observability.md), recorded
#: in batches 50 ms after the first.
scheduler = _Keepalive()
callbacks = _Callbacks()
telemetry = _Callbacks("pglock-telemetry", 10_000, 0.05)


def fresh() -> None:
    """New threads and queues (in a forked child: the parent's grants stay the parent's)."""
    global scheduler, callbacks, telemetry
    scheduler, callbacks = _Keepalive(), _Callbacks()
    telemetry = _Callbacks("pglock-telemetry", 10_000, 0.05)
