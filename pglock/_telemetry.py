"""OpenTelemetry metrics and spans for pglock's locks, off until :func:`configure_telemetry`
(docs/observability.md).

Off means nothing installed: the lock classes run their own methods. Enabling swaps wrapping
methods in on those classes (and on ``pglock._xact.xact_acquire``); disabling swaps the
originals back. ``opentelemetry`` is imported only here, inside :func:`configure_telemetry`.

The wrappers capture values (clocks, names, tokens, the OpenTelemetry context) and queue them:
the SDK and the application's ``name_label`` run on pglock's telemetry thread, so that a slow
or failing exporter delays no lock call, renewal or callback. A full queue drops what comes.

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

from . import _keepalive
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

#: The hold in progress on a lock object (``_HOLD``): (perf_counter at the grant, _Series).
_HOLD = "_pglock_telemetry_hold"
#: A lease whose loss was counted when it was found (its release's LockLost is not counted).
_COUNTED = "_pglock_telemetry_lost"

_lock = threading.Lock()
_local = threading.local()
_state: _State | None = None
#: What enabling replaced: (owner, attribute, the owner's own value or _ABSENT).
_replaced: list[tuple[Any, str, Any]] = []
_ABSENT = object()
#: The failures logged at WARNING since telemetry was enabled (the next ones are DEBUG).
_warned: set[str] = set()


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
    Recording runs on a thread of pglock's, just after the lock call.

    :param enabled: False turns telemetry off again (the lock classes' own methods back) and
        waits up to 5 s until what was queued is recorded.
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
            flush(5.0)
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
        _warned.clear()
        if not _replaced:
            _install()


def flush(timeout: float) -> bool:
    """Wait until what was queued is recorded (False: not within ``timeout`` seconds)."""
    return _keepalive.telemetry.flush(timeout)


class _State:
    """The instruments and settings in force while enabled."""

    def __init__(
        self, meter: Any, tracer: Any, name_label: Callable[[str], str | None] | None,
        threshold: float,
    ) -> None:
        from opentelemetry.context import get_current
        from opentelemetry.trace import Status, StatusCode

        self.tracer = tracer
        self.name_label = name_label
        self.threshold = threshold
        self.context: Callable[[], Any] = get_current
        self.error_status: Callable[[str], Any] = lambda what: Status(StatusCode.ERROR, what)
        self.wait = _histogram(
            meter, "pglock.lock.wait.duration",
            "Time spent in acquire(), whatever its outcome (pglock.outcome).",
        )
        self.hold = _histogram(
            meter, "pglock.lock.hold.duration", "Time from a grant to its release."
        )
        self.counted = {  # the counter of each outcome that has one
            "acquired": meter.create_counter(
                "pglock.lock.acquisitions", unit="{acquisition}", description="Locks granted."
            ),
            "timeout": meter.create_counter(
                "pglock.lock.timeouts", unit="{timeout}",
                description="Acquires that ended without the lock (LockNotAcquired, or False).",
            ),
            "deadlock": meter.create_counter(
                "pglock.lock.deadlocks", unit="{deadlock}",
                description="Waits that Postgres broke as a deadlock (DeadlockDetected).",
            ),
        }
        self.losses = meter.create_counter(
            "pglock.lock.losses", unit="{loss}",
            description="Held locks found lost (LockLost): expired, taken over, session ended.",
        )
        self.waiters = meter.create_up_down_counter(
            "pglock.lock.waiters", unit="{waiter}", description="Threads waiting in acquire() now."
        )

    def span(
        self, span_name: str, start_ns: int, end_ns: int, attributes: dict[str, Any],
        context: Any, exc: BaseException | None = None, error: str | None = None,
    ) -> None:
        span = self.tracer.start_span(span_name, context=context, start_time=start_ns,
                                      attributes=attributes)
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


def _emit(record: Callable[..., object], *args: Any) -> bool:
    """Queue ``record(*args)`` for the telemetry thread (False: the queue was full)."""
    dropped = _keepalive.telemetry.call(functools.partial(_quietly, record, *args))
    if dropped:
        logger.log(logging.WARNING if dropped == 1 else logging.DEBUG,
                   "pglock telemetry: its queue is full (a stuck exporter?), %d recordings "
                   "dropped so far (the lock is unaffected)", dropped)
    return not dropped


def _quietly(record: Callable[..., object], *args: Any) -> None:
    """Run ``record(*args)`` on the telemetry thread: an error of the SDK, or of the
    application's span processor, exporter or name_label, is logged, never raised; the thread
    goes on even after a BaseException (an exporter's CancelledError)."""
    try:
        record(*args)
    except BaseException:
        _log_once("failed", "pglock telemetry: recording failed (the lock is unaffected)")


def _log_once(what: str, message: str) -> None:
    level = logging.DEBUG if what in _warned else logging.WARNING
    _warned.add(what)
    logger.log(level, message, exc_info=True)


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


class _Series:
    """The metric series of an acquire and of the hold it begins: its kind and the lock's name."""

    __slots__ = ("_attrs", "claimed", "kind", "name")

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name
        self.claimed = False  # an inner lock that holds took the hold over
        self._attrs: dict[str, str] | None = None

    def attrs(self, st: _State) -> dict[str, str]:
        """Its metric attributes, labelled once, on the telemetry thread (the name_label is the
        application's code)."""
        if self._attrs is None:
            try:
                label = None if st.name_label is None else st.name_label(self.name)
            except Exception:
                _log_once("name_label", "pglock telemetry: name_label raised; no name attribute")
                label = None
            self._attrs = {KIND: self.kind} if label is None else {KIND: self.kind,
                                                                   NAME: str(label)}
        return self._attrs


def _wait(
    st: _State, series: _Series, obj: Any, call: Callable[[], Any],
    info: Callable[[Any], dict[str, Any]],
    extra: Callable[[Any, Any], dict[str, Any]] | None = None,
) -> Any:
    """Run one acquire ``call()``, the outermost of the thread (other acquires in it record
    nothing of their own), and queue its recording. A leader's campaign round records a wait
    only when it wins the lock or fails (a follower retries every interval)."""
    _local.outer = series
    start_ns = time.time_ns()
    t0 = time.perf_counter()
    begun = _emit(_waiting, st, series)
    result: Any = None
    exc: BaseException | None = None
    try:
        result = call()
        return result
    except BaseException as e:
        exc = e
        raise
    finally:
        _local.outer = None
        elapsed = time.perf_counter() - t0
        kind, error = series.kind, None
        if exc is None and result:
            outcome: str | None = "acquired"
            if not series.claimed and kind != "xact":
                setattr(result if kind == "semaphore" else obj, _HOLD, (time.perf_counter(),
                                                                       series))
                if kind == "lease":
                    obj.__dict__.pop(_COUNTED, None)
        elif exc is None or isinstance(exc, LockNotAcquired):
            outcome = None if kind == "leader" else "timeout"
        else:
            outcome = error = "deadlock" if isinstance(exc, DeadlockDetected) else "error"
        span = None
        if elapsed >= st.threshold and outcome is not None and not (error and kind == "leader"):
            attrs = {KIND: kind, OUTCOME: outcome, **info(obj)}
            if extra is not None and outcome == "acquired":
                attrs.update(extra(obj, result))
            span = (start_ns, start_ns + int(elapsed * 1e9), attrs, st.context(), exc, error)
        _emit(_record_wait, st, series, begun, outcome, elapsed, span)


def _waiting(st: _State, series: _Series) -> None:
    st.waiters.add(1, series.attrs(st))


def _record_wait(
    st: _State, series: _Series, begun: bool, outcome: str | None, elapsed: float,
    span: tuple[Any, ...] | None,
) -> None:
    attrs = series.attrs(st)
    if begun:  # not when the +1 was dropped
        st.waiters.add(-1, attrs)
    if outcome is not None:
        if outcome in st.counted:
            st.counted[outcome].add(1, attrs)
        st.wait.record(elapsed, {**attrs, OUTCOME: outcome})
    if span is not None:
        st.span("pglock.lock.wait", *span)


def _record_end(
    st: _State, series: _Series, held: float | None, lost: bool, span: tuple[Any, ...] | None
) -> None:
    """A hold ended after ``held`` seconds (None: not timed), lost or not, maybe with a span."""
    attrs = series.attrs(st)
    if held is not None:
        st.hold.record(held, attrs)
    if lost:
        st.losses.add(1, attrs)
    if span is not None:
        st.span("pglock.lease.lost", *span)


def _lost_span(st: _State, lease: Any, reason: str) -> tuple[Any, ...]:
    now = time.time_ns()
    attrs = {KIND: "lease", **_lease_info(lease), "pglock.lost.reason": reason}
    return now, now, attrs, st.context()


# The wrappers, one maker per hook.

def _acquire_wrapper(
    orig: Callable[..., Any], kind: str, info: Callable[[Any], dict[str, Any]], holds: bool,
    name: Callable[[Any], str], extra: Callable[[Any, Any], dict[str, Any]] | None = None,
) -> Callable[..., Any]:
    def acquire(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _state
        if st is None:
            return orig(self, *args, **kwargs)
        outer: _Series | None = getattr(_local, "outer", None)
        if outer is not None:  # inside another lock's acquire: it records
            result = orig(self, *args, **kwargs)
            if result and holds and not outer.claimed:
                outer.claimed = True
                setattr(self, _HOLD, (time.perf_counter(), outer))
            return result
        leader = getattr(_local, "leader", None)
        if leader is not None and kind == "advisory":  # a round of a leader's campaign
            return _wait(st, _Series("leader", leader._name), leader,
                         lambda: orig(self, *args, **kwargs),
                         lambda e: _span_attrs([e._name], [e._key]))
        return _wait(st, _Series(kind, name(self)), self, lambda: orig(self, *args, **kwargs),
                     info, extra)

    acquire.__wrapped__ = orig  # type: ignore[attr-defined]
    return acquire


def _release_wrapper(
    orig: Callable[..., Any], kind: str, name: Callable[[Any], str], holder_arg: bool = False,
) -> Callable[..., Any]:
    def release(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _state
        if st is None:
            return orig(self, *args, **kwargs)
        holder = args[0] if holder_arg else self  # a semaphore's permit
        counted = kind == "lease" and self.__dict__.get(_COUNTED, False)
        lost: LockLost | None = None
        try:
            return orig(self, *args, **kwargs)
        except LockLost as exc:
            lost = None if counted else exc
            raise
        finally:
            hold = holder.__dict__.pop(_HOLD, None)  # None: begun while telemetry was off
            if hold is not None or lost is not None:
                span = None
                if lost is not None and kind == "lease":
                    span = _lost_span(st, self, getattr(lost, "reason", str(lost)))
                _emit(_record_end, st, hold[1] if hold else _Series(kind, name(self)),
                      time.perf_counter() - hold[0] if hold else None, lost is not None, span)

    release.__wrapped__ = orig  # type: ignore[attr-defined]
    return release


def _lease_lose_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _lose(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _state
        before = self._state
        result = orig(self, *args, **kwargs)
        if st is not None and before is not self._state and self._state.value == "lost":
            self.__dict__[_COUNTED] = True
            hold = self.__dict__.get(_HOLD)
            series = hold[1] if hold is not None else _Series("lease", self._name)
            _emit(_record_end, st, series, None, True, _lost_span(st, self, self._lost_reason))
        return result

    _lose.__wrapped__ = orig  # type: ignore[attr-defined]
    return _lose


def _renew_failed_wrapper(
    orig: Callable[..., Any], kind: str, info: Callable[[Any], dict[str, Any]]
) -> Callable[..., Any]:
    def _renew_failed(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        st = _state
        if st is not None:
            exc = sys.exc_info()[1]  # called in the renewal's except block
            attrs = {KIND: kind, **info(self)}
            if exc is not None:
                attrs["error.type"] = type(exc).__qualname__
            now = time.time_ns()
            _emit(st.span, "pglock.lease.keepalive", now, now, attrs, st.context(), exc,
                  "renewal failed, retrying")
        return result

    _renew_failed.__wrapped__ = orig  # type: ignore[attr-defined]
    return _renew_failed


# Leader election: its background thread's campaign rounds (a pg_lock acquire each).

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


def _leader_lose_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _lose(self: Any, reason: str, *args: Any, **kwargs: Any) -> Any:
        was_leader = self._leader
        result = orig(self, reason, *args, **kwargs)
        st = _state
        hold = self.__dict__.pop(_HOLD, None)
        if st is not None and hold is not None:
            lost = was_leader and reason not in _STEPPED_DOWN
            _emit(_record_end, st, hold[1], time.perf_counter() - hold[0], lost, None)
        return result

    _lose.__wrapped__ = orig  # type: ignore[attr-defined]
    return _lose


def _xact_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def xact_acquire(target: Any, keys: list[int], names: list[str], **kwargs: Any) -> Any:
        st = _state
        if st is None or kwargs.get("api", "xact_lock") not in ("xact_lock", "try_xact_lock"):
            return orig(target, keys, names, **kwargs)
        return _wait(st, _Series("xact", _first(names)), None,
                     lambda: orig(target, keys, names, **kwargs),
                     lambda _: _span_attrs(names, keys))

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
        (PgLock, "release", lambda f: _release_wrapper(f, "advisory", names0)),
        (PoolLock, "_acquire", lambda f: _acquire_wrapper(f, "pool", _pool_lock_info, False,
                                                         names0)),
        (RWHold, "_acquire", lambda f: _acquire_wrapper(f, "rwlock", _rwlock_info, False,
                                                       rw_name)),
        (Lease, "_acquire", lambda f: _acquire_wrapper(f, "lease", _lease_info, True, own_name,
                                                      lease_extra)),
        (Lease, "release", lambda f: _release_wrapper(f, "lease", own_name)),
        (Lease, "_lose", _lease_lose_wrapper),
        (Lease, "_renew_failed", lambda f: _renew_failed_wrapper(f, "lease", _lease_info)),
        (Semaphore, "_take", lambda f: _acquire_wrapper(
            f, "semaphore", lambda s: _span_attrs([s._name]), False, own_name, permit_extra)),
        (Semaphore, "_release_permit", lambda f: _release_wrapper(
            f, "semaphore", own_name, holder_arg=True)),
        (Permit, "_renew_failed", lambda f: _renew_failed_wrapper(
            f, "semaphore", lambda p: _span_attrs([p.name], holder=p.holder))),
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
