"""OpenTelemetry metrics and spans for pglock's locks, off until :func:`configure_telemetry`
(docs/observability.md).

Off means nothing installed: the lock classes run their own methods. Enabling swaps wrapping
methods in on those classes (and on ``pglock._xact.xact_acquire``); disabling swaps the
originals back. ``opentelemetry`` is imported only here, inside :func:`configure_telemetry`.

Locks built on other locks (an rwlock or a singleton on a ``pg_lock`` or a ``pool_lock``, a
``pool_lock`` on a ``pg_lock``, a leader's campaign) are recorded once, by the outermost
acquire of the thread, under its kind; the hold is timed by the lock that really holds (the
inner ``pg_lock``, a lease, a semaphore permit), under the outer kind.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._keys import exact
from .errors import DeadlockDetected, LockLost, LockNotAcquired

logger = logging.getLogger("pglock.telemetry")

KIND = "pglock.lock.kind"
NAME = "pglock.lock.name"
OUTCOME = "pglock.outcome"

#: Bucket boundaries (seconds) advised for the wait and hold histograms: the SDK's default
#: ones (0 to 10000) suit milliseconds. Views of the application's SDK take precedence.
_BUCKETS = (
    0.0, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
)

#: The hold in progress on a lock object (``_HOLD``): (perf_counter at the grant, attributes).
_HOLD = "_pglock_telemetry_hold"
#: A lease whose loss was counted when it was found (its release's LockLost is not counted).
_COUNTED = "_pglock_telemetry_lost"

_lock = threading.Lock()
_local = threading.local()
_state: _State | None = None
#: What enabling replaced: (owner, attribute, the owner's own value or _ABSENT).
_replaced: list[tuple[Any, str, Any]] = []
_ABSENT = object()


def configure_telemetry(
    *,
    enabled: bool = True,
    name_label: Callable[[str], str | None] | None = None,
    span_threshold: float = 0.0,
    meter_provider: Any = None,
    tracer_provider: Any = None,
) -> None:
    """Record OpenTelemetry metrics and spans of pglock's locks (docs/observability.md).

    Needs ``pip install "pglock[otel]"`` (``opentelemetry-api``) and, for anything to be
    exported, an OpenTelemetry SDK configured by the application. Until this is called pglock
    records nothing and its lock methods are untouched; calling it again replaces the settings.

    :param enabled: False turns telemetry off again (the lock classes' own methods back).
    :param name_label: maps a lock name to a low-cardinality label put on metrics as
        ``pglock.lock.name`` (None from it: no name attribute). Default: no name on metrics.
        Spans always carry the name.
    :param span_threshold: seconds; a ``pglock.lock.wait`` span is made for waits that lasted
        at least this long (default 0: every wait).
    :param meter_provider: the ``MeterProvider`` to use; default the global one.
    :param tracer_provider: the ``TracerProvider`` to use; default the global one.
    :raises ImportError: ``opentelemetry-api`` is not installed.
    :raises TypeError, ValueError: a bad argument.

    Example::

        pglock.configure_telemetry(name_label=lambda name: name.split(":")[0])
    """
    global _state
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, not {type(enabled).__name__}")
    if name_label is not None and not callable(name_label):
        raise TypeError(f"name_label must be callable or None, not {type(name_label).__name__}")
    if isinstance(span_threshold, bool) or not isinstance(span_threshold, (int, float)):
        raise TypeError(f"span_threshold must be seconds, not {type(span_threshold).__name__}")
    if not ((span_threshold := exact(span_threshold)) >= 0 and math.isfinite(span_threshold)):
        raise ValueError(f"span_threshold must be a finite number >= 0, not {span_threshold!r}")
    with _lock:
        if not enabled:
            _state = None
            _uninstall()
            return
        try:
            from opentelemetry import metrics, trace
        except ImportError as exc:
            raise ImportError(
                'pglock telemetry needs opentelemetry-api: pip install "pglock[otel]"'
            ) from exc
        # The package's version, read without importing pglock from here (an import cycle).
        version = getattr(sys.modules.get(__package__ or "pglock"), "__version__", None)
        if meter_provider is None:
            meter_provider = metrics.get_meter_provider()
        if tracer_provider is None:
            tracer_provider = trace.get_tracer_provider()
        meter = meter_provider.get_meter("pglock", version)
        tracer = tracer_provider.get_tracer("pglock", version)
        _state = _State(meter, tracer, name_label, float(span_threshold))
        if not _replaced:
            _install()


class _State:
    """The instruments and settings in force while enabled."""

    def __init__(
        self, meter: Any, tracer: Any, name_label: Callable[[str], str | None] | None,
        threshold: float,
    ) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.tracer = tracer
        self.name_label = name_label
        self.threshold = threshold
        self.error_status: Callable[[str], Any] = lambda what: Status(StatusCode.ERROR, what)
        self.wait = _histogram(
            meter, "pglock.lock.wait.duration",
            "Time spent in acquire(), whatever its outcome (pglock.outcome).",
        )
        self.hold = _histogram(
            meter, "pglock.lock.hold.duration", "Time from a grant to its release."
        )
        self.acquisitions = meter.create_counter(
            "pglock.lock.acquisitions", unit="{acquisition}", description="Locks granted."
        )
        self.timeouts = meter.create_counter(
            "pglock.lock.timeouts", unit="{timeout}",
            description="Acquires that ended without the lock (LockNotAcquired, or False).",
        )
        self.losses = meter.create_counter(
            "pglock.lock.losses", unit="{loss}",
            description="Held locks found lost (LockLost): expired, taken over, session ended.",
        )
        self.deadlocks = meter.create_counter(
            "pglock.lock.deadlocks", unit="{deadlock}",
            description="Waits that Postgres broke as a deadlock (DeadlockDetected).",
        )
        self.waiters = meter.create_up_down_counter(
            "pglock.lock.waiters", unit="{waiter}", description="Threads waiting in acquire() now."
        )
        self._plain: dict[str, dict[str, str]] = {}
        self._warned = False

    def attrs(self, kind: str, name: Callable[[], str]) -> dict[str, str]:
        """The metric attributes of a lock of ``kind``; ``name()`` only with a name_label."""
        label_of = self.name_label
        if label_of is None:
            plain = self._plain.get(kind)
            if plain is None:
                plain = self._plain.setdefault(kind, {KIND: kind})
            return plain
        attrs = {KIND: kind}
        try:
            label = label_of(name())
        except Exception:
            if not self._warned:
                self._warned = True
                logger.warning("pglock telemetry: name_label raised; no name attribute",
                               exc_info=True)
            return attrs
        if label is not None:
            attrs[NAME] = str(label)
        return attrs

    def span(
        self, span_name: str, start_ns: int, end_ns: int, attributes: dict[str, Any],
        exc: BaseException | None = None, error: str | None = None,
    ) -> None:
        span = self.tracer.start_span(span_name, start_time=start_ns, attributes=attributes)
        if exc is not None:
            span.record_exception(exc)
        if error is not None:
            span.set_status(self.error_status(error))
        span.end(end_time=end_ns)


def _histogram(meter: Any, name: str, description: str) -> Any:
    try:
        return meter.create_histogram(
            name, unit="s", description=description,
            explicit_bucket_boundaries_advisory=list(_BUCKETS),
        )
    except TypeError:  # opentelemetry-api before 1.23: no advice
        return meter.create_histogram(name, unit="s", description=description)


# What each lock kind tells spans: its names, keys, holder id and fencing token.

def _first(names: Sequence[str]) -> str:
    return names[0] if names else ""


def _span_attrs(
    names: Sequence[str], keys: Sequence[int] | None = None, holder: str | None = None,
    token: int | None = None,
) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "pglock.lock.name": names[0] if len(names) == 1 else list(names),
    }
    if keys is not None:
        attrs["pglock.lock.key"] = keys[0] if len(keys) == 1 else list(keys)
    if holder is not None:
        attrs["pglock.lock.holder"] = holder
    if token is not None:
        attrs["pglock.lock.token"] = token
    return attrs


def _pg_lock_info(obj: Any) -> dict[str, Any]:
    return _span_attrs(obj._names, obj._keys)


def _pool_lock_info(obj: Any) -> dict[str, Any]:
    return _span_attrs([n for _, n in obj._pairs], [k for k, _ in obj._pairs])


def _rwlock_info(obj: Any) -> dict[str, Any]:
    return _span_attrs([obj._rw.name], [obj._rw.key])


def _lease_info(obj: Any) -> dict[str, Any]:
    return _span_attrs([obj._name], holder=obj._holder, token=obj._token)


def _semaphore_info(obj: Any, permit: Any = None) -> dict[str, Any]:
    return _span_attrs([obj._name], holder=None if permit is None else permit.holder)


class _Outer:
    """The outermost acquire running in this thread (inner locks record nothing of their own)."""

    __slots__ = ("attrs", "claimed")

    def __init__(self, attrs: dict[str, str]) -> None:
        self.attrs = attrs
        self.claimed = False  # an inner lock that holds took the hold over


def _wait(
    st: _State, kind: str, attrs: dict[str, str], info: Callable[[Any], dict[str, Any]],
    obj: Any, call: Callable[[], Any], extra: Callable[[Any, Any], dict[str, Any]] | None = None,
) -> Any:
    """Run one acquire ``call()`` as the outermost of the thread and record it."""
    outer = _local.outer = _Outer(attrs)
    start_ns = time.time_ns()
    t0 = time.perf_counter()
    _quietly(lambda: st.waiters.add(1, attrs))
    exc: BaseException | None = None
    result: Any = None
    try:
        result = call()
        return result
    except BaseException as e:
        exc = e
        raise
    finally:
        _local.outer = None
        elapsed = time.perf_counter() - t0
        _quietly(lambda: st.waiters.add(-1, attrs))
        _quietly(lambda: _record_wait(
            st, kind, attrs, info, obj, result, exc, start_ns, elapsed, outer, extra
        ))


def _record_wait(
    st: _State, kind: str, attrs: dict[str, str], info: Callable[[Any], dict[str, Any]],
    obj: Any, result: Any, exc: BaseException | None, start_ns: int, elapsed: float,
    outer: _Outer, extra: Callable[[Any, Any], dict[str, Any]] | None,
) -> None:
    error = None
    if exc is None and result:
        outcome = "acquired"
        st.acquisitions.add(1, attrs)
        if not outer.claimed:
            holder = result if kind == "semaphore" else obj
            if kind != "xact":
                setattr(holder, _HOLD, (time.perf_counter(), attrs))
                if kind == "lease":
                    obj.__dict__.pop(_COUNTED, None)
    elif exc is None or isinstance(exc, LockNotAcquired):
        outcome = "timeout"
        st.timeouts.add(1, attrs)
    elif isinstance(exc, DeadlockDetected):
        outcome = error = "deadlock"
        st.deadlocks.add(1, attrs)
    else:
        outcome = error = "error"
    st.wait.record(elapsed, {**attrs, OUTCOME: outcome})
    if elapsed >= st.threshold:
        span_attrs = {KIND: kind, OUTCOME: outcome, **info(obj)}
        if extra is not None and exc is None and result:
            span_attrs.update(extra(obj, result))
        st.span("pglock.lock.wait", start_ns, start_ns + int(elapsed * 1e9), span_attrs, exc,
                error)


def _held(st: _State, obj: Any) -> tuple[float, dict[str, str]] | None:
    """Take the hold recorded on ``obj`` (None: begun while telemetry was off) and time it."""
    hold = obj.__dict__.pop(_HOLD, None)
    if hold is not None:
        st.hold.record(time.perf_counter() - hold[0], hold[1])
    return hold  # type: ignore[no-any-return]


_failed_before = False


def _quietly(record: Callable[[], object]) -> None:
    """Run ``record()``, a recording: telemetry never changes what a lock call returns or
    raises, nor leaves a lock held behind an error of its own. An error of the SDK, or of a
    span processor or exporter of the application's, is logged (the first at WARNING)."""
    global _failed_before
    try:
        record()
    except Exception:
        level = logging.DEBUG if _failed_before else logging.WARNING
        _failed_before = True
        logger.log(level, "pglock telemetry: recording failed (the lock is unaffected)",
                   exc_info=True)


# The wrappers, one maker per hook.

def _acquire_wrapper(
    orig: Callable[..., Any], kind: str, info: Callable[[Any], dict[str, Any]], holds: bool,
    name: Callable[[Any], str], extra: Callable[[Any, Any], dict[str, Any]] | None = None,
) -> Callable[..., Any]:
    def acquire(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _state
        if st is None:
            return orig(self, *args, **kwargs)
        outer: _Outer | None = getattr(_local, "outer", None)
        if outer is not None:  # inside another lock's acquire: it records
            result = orig(self, *args, **kwargs)
            if result and holds and not outer.claimed:
                outer.claimed = True
                setattr(self, _HOLD, (time.perf_counter(), outer.attrs))
            return result
        leader = getattr(_local, "leader", None)
        if leader is not None and kind == "advisory":
            return _campaign_round(st, leader, self, lambda: orig(self, *args, **kwargs))
        attrs = st.attrs(kind, lambda: name(self))
        return _wait(st, kind, attrs, info, self, lambda: orig(self, *args, **kwargs), extra)

    acquire.__wrapped__ = orig  # type: ignore[attr-defined]
    return acquire


def _release_wrapper(
    orig: Callable[..., Any], kind: str, name: Callable[[Any], str],
    info: Callable[[Any], dict[str, Any]], holder_arg: bool = False,
) -> Callable[..., Any]:
    def release(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _state
        if st is None:
            return orig(self, *args, **kwargs)
        holder = args[0] if holder_arg else self  # a semaphore's permit
        counted = kind == "lease" and self.__dict__.get(_COUNTED, False)
        try:
            return orig(self, *args, **kwargs)
        except LockLost as exc:
            if not counted:
                _quietly(functools.partial(_count_loss, st, kind, self, holder, name, exc))
            raise
        finally:
            _quietly(lambda: _held(st, holder))

    release.__wrapped__ = orig  # type: ignore[attr-defined]
    return release


def _count_loss(
    st: _State, kind: str, lock: Any, holder: Any, name: Callable[[Any], str], exc: LockLost
) -> None:
    hold = holder.__dict__.get(_HOLD)
    attrs = hold[1] if hold is not None else st.attrs(kind, lambda: name(lock))
    st.losses.add(1, attrs)
    if kind == "lease":
        _lease_lost_span(st, lock, exc.reason if hasattr(exc, "reason") else str(exc))


def _lease_lost_span(st: _State, lease: Any, reason: str) -> None:
    now = time.time_ns()
    attrs = {KIND: "lease", **_lease_info(lease), "pglock.lost.reason": reason}
    st.span("pglock.lease.lost", now, now, attrs)


def _count_lease_lost(st: _State, lease: Any) -> None:
    hold = lease.__dict__.get(_HOLD)
    attrs = hold[1] if hold is not None else st.attrs("lease", lambda: lease._name)
    st.losses.add(1, attrs)
    _lease_lost_span(st, lease, lease._lost_reason)


def _lease_lose_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _lose(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _state
        before = self._state
        result = orig(self, *args, **kwargs)
        if st is not None and before is not self._state and self._state.value == "lost":
            self.__dict__[_COUNTED] = True
            _quietly(lambda: _count_lease_lost(st, self))
        return result

    _lose.__wrapped__ = orig  # type: ignore[attr-defined]
    return _lose


def _keepalive_span(
    st: _State, kind: str, info: dict[str, Any], exc: BaseException | None
) -> None:
    now = time.time_ns()
    attrs = {KIND: kind, **info}
    if exc is not None:
        attrs["error.type"] = type(exc).__qualname__
    st.span("pglock.lease.keepalive", now, now, attrs, exc, "renewal failed, retrying")


def _renew_failed_wrapper(
    orig: Callable[..., Any], kind: str, info: Callable[[Any], dict[str, Any]]
) -> Callable[..., Any]:
    def _renew_failed(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        st = _state
        if st is not None:
            exc = sys.exc_info()[1]  # called in the renewal's except block
            _quietly(lambda: _keepalive_span(st, kind, info(self), exc))
        return result

    _renew_failed.__wrapped__ = orig  # type: ignore[attr-defined]
    return _renew_failed


def _permit_info(permit: Any) -> dict[str, Any]:
    return _span_attrs([permit.name], holder=permit.holder)


# Leader election: its background thread's campaign rounds (a pg_lock acquire each).

def _campaign_round(st: _State, election: Any, lock: Any, call: Callable[[], Any]) -> Any:
    """One round of a leader's campaign: recorded as kind ``leader`` when it wins the lock;
    rounds that do not win record nothing but the waiter (a follower retries every interval)."""
    attrs = st.attrs("leader", lambda: election._name)
    start_ns = time.time_ns()
    t0 = time.perf_counter()
    _quietly(lambda: st.waiters.add(1, attrs))
    try:
        won = call()
    except BaseException as exc:
        elapsed = time.perf_counter() - t0
        outcome = "deadlock" if isinstance(exc, DeadlockDetected) else "error"
        _quietly(lambda: st.wait.record(elapsed, {**attrs, OUTCOME: outcome}))
        raise
    finally:
        _quietly(lambda: st.waiters.add(-1, attrs))
    if won:
        elapsed = time.perf_counter() - t0
        election.__dict__[_HOLD] = (time.perf_counter(), attrs)
        _quietly(lambda: _record_win(st, election, attrs, start_ns, elapsed))
    return won


def _record_win(
    st: _State, election: Any, attrs: dict[str, str], start_ns: int, elapsed: float
) -> None:
    st.acquisitions.add(1, attrs)
    st.wait.record(elapsed, {**attrs, OUTCOME: "acquired"})
    if elapsed >= st.threshold:
        span_attrs = {KIND: "leader", OUTCOME: "acquired",
                      **_span_attrs([election._name], [election._key])}
        st.span("pglock.lock.wait", start_ns, start_ns + int(elapsed * 1e9), span_attrs)


def _campaign_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _campaign_and_lead(self: Any, *args: Any, **kwargs: Any) -> Any:
        _local.leader = self
        try:
            return orig(self, *args, **kwargs)
        finally:
            _local.leader = None

    _campaign_and_lead.__wrapped__ = orig  # type: ignore[attr-defined]
    return _campaign_and_lead


#: Reasons a leadership ends that are no loss: the candidate stepped down.
_STEPPED_DOWN = ("resigned", "the campaign stopped")


def _record_leadership(st: _State, hold: tuple[float, dict[str, str]], lost: bool) -> None:
    st.hold.record(time.perf_counter() - hold[0], hold[1])
    if lost:
        st.losses.add(1, hold[1])


def _leader_lose_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _lose(self: Any, reason: str, *args: Any, **kwargs: Any) -> Any:
        was_leader = self._leader
        result = orig(self, reason, *args, **kwargs)
        st = _state
        hold = self.__dict__.pop(_HOLD, None)
        if st is not None and hold is not None:
            lost = was_leader and reason not in _STEPPED_DOWN
            _quietly(lambda: _record_leadership(st, hold, lost))
        return result

    _lose.__wrapped__ = orig  # type: ignore[attr-defined]
    return _lose


def _xact_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def xact_acquire(target: Any, keys: list[int], names: list[str], **kwargs: Any) -> Any:
        st = _state
        if st is None or kwargs.get("api", "xact_lock") not in ("xact_lock", "try_xact_lock"):
            return orig(target, keys, names, **kwargs)
        attrs = st.attrs("xact", lambda: _first(names))
        return _wait(
            st, "xact", attrs, lambda _: _span_attrs(names, keys), None,
            lambda: orig(target, keys, names, **kwargs),
        )

    xact_acquire.__wrapped__ = orig  # type: ignore[attr-defined]
    return xact_acquire


def _hooks() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    """(owner, attribute, wrapper maker) for every hook point."""
    from . import _xact
    from ._advisory import PgLock
    from ._leader import LeaderElection
    from ._lease import Lease
    from ._pool import PoolLock
    from ._rwlock import RWHold
    from ._semaphore import Permit, Semaphore

    def lease_extra(obj: Any, _: Any) -> dict[str, Any]:
        return {"pglock.lock.token": obj._token}

    def permit_extra(_: Any, permit: Any) -> dict[str, Any]:
        return {"pglock.lock.holder": permit.holder}

    def names0(obj: Any) -> str:
        return _first(obj.names)

    def rw_name(obj: Any) -> str:
        return str(obj._rw.name)

    def own_name(obj: Any) -> str:
        return str(obj._name)

    return [
        (PgLock, "_acquire", lambda f: _acquire_wrapper(f, "advisory", _pg_lock_info, True,
                                                       names0)),
        (PgLock, "release", lambda f: _release_wrapper(f, "advisory", names0, _pg_lock_info)),
        (PoolLock, "_acquire", lambda f: _acquire_wrapper(f, "pool", _pool_lock_info, False,
                                                         names0)),
        (RWHold, "_acquire", lambda f: _acquire_wrapper(f, "rwlock", _rwlock_info, False,
                                                       rw_name)),
        (Lease, "_acquire", lambda f: _acquire_wrapper(f, "lease", _lease_info, True, own_name,
                                                      lease_extra)),
        (Lease, "release", lambda f: _release_wrapper(f, "lease", own_name, _lease_info)),
        (Lease, "_lose", _lease_lose_wrapper),
        (Lease, "_renew_failed", lambda f: _renew_failed_wrapper(f, "lease", _lease_info)),
        (Semaphore, "_take", lambda f: _acquire_wrapper(f, "semaphore", _semaphore_info, False,
                                                       own_name, permit_extra)),
        (Semaphore, "_release_permit", lambda f: _release_wrapper(
            f, "semaphore", own_name, _semaphore_info, holder_arg=True)),
        (Permit, "_renew_failed", lambda f: _renew_failed_wrapper(f, "semaphore", _permit_info)),
        (LeaderElection, "_campaign_and_lead", _campaign_wrapper),
        (LeaderElection, "_lose", _leader_lose_wrapper),
        (_xact, "xact_acquire", _xact_wrapper),
    ]


def _install() -> None:
    for owner, attr, make in _hooks():
        own = owner.__dict__.get(attr, _ABSENT)
        _replaced.append((owner, attr, own))
        setattr(owner, attr, make(getattr(owner, attr)))


def _uninstall() -> None:
    while _replaced:
        owner, attr, own = _replaced.pop()
        if own is _ABSENT:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)


def installed() -> bool:
    """True while wrappers are swapped in (tests)."""
    return bool(_replaced)
