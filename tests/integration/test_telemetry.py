"""OpenTelemetry metrics and spans (pglock.configure_telemetry, docs/observability.md).

Each test gives pglock an SDK MeterProvider with an in-memory reader and a TracerProvider with
an in-memory exporter (never the global providers), plays a scripted scenario against the real
server and checks every point and span it yields. Telemetry is off again after each test.
Waits are made by a holder that releases after a set time: sums are checked to be at least
that long, never bounded above.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from psycopg_pool import ConnectionPool
from test_lease_support import wait_until

import pglock
from pglock import _advisory, _keepalive, _telemetry, _xact

pytestmark = pytest.mark.timeout(60)


Attrs = frozenset[tuple[str, Any]]


class Telemetry:
    """An SDK meter and tracer provider with in-memory reader and exporter, given to pglock."""

    def __init__(self, processors: Sequence[SpanProcessor] = (), **meter_options: Any) -> None:
        self.reader = InMemoryMetricReader()
        # Read while a scenario runs (points(probe=True)), so that the final reading is the
        # reader's first: opentelemetry-sdk 1.20 (the lower bound) leaves out a cumulative
        # histogram point not updated since the reader's previous collection.
        self.probe = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader, self.probe], **meter_options)
        self.exporter = InMemorySpanExporter()
        self.tracers = TracerProvider()
        self.tracers.add_span_processor(SimpleSpanProcessor(self.exporter))
        for processor in processors:  # after the in-memory exporter: it has the span first
            self.tracers.add_span_processor(processor)

    def configure(self, **kwargs: Any) -> None:
        pglock.configure_telemetry(
            meter_provider=self.meters, tracer_provider=self.tracers, **kwargs
        )

    def points(self, *, probe: bool = False) -> dict[str, dict[Attrs, Any]]:
        """{instrument: {attributes: value}}; a histogram's value is (count, sum), once what
        pglock queued is recorded."""
        assert _telemetry.flush(20)
        found: dict[str, dict[Attrs, Any]] = {}
        data = (self.probe if probe else self.reader).get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                assert sm.scope.name == "pglock"
                for metric in sm.metrics:
                    into = found.setdefault(metric.name, {})
                    for p in metric.data.data_points:
                        attrs = frozenset(p.attributes.items())
                        into[attrs] = (p.count, p.sum) if hasattr(p, "count") else p.value
        return found

    def spans(self, name: str | None = None) -> list[Any]:
        assert _telemetry.flush(20)
        return [s for s in self.exporter.get_finished_spans() if name in (None, s.name)]


def a(kind: str, **more: str) -> Attrs:
    """Metric attributes: the kind, an outcome, a name label."""
    attrs = {"pglock.lock.kind": kind}
    if "outcome" in more:
        attrs["pglock.outcome"] = more.pop("outcome")
    if "label" in more:
        attrs["pglock.lock.name"] = more.pop("label")
    assert not more
    return frozenset(attrs.items())


def counts(points: dict[str, dict[Attrs, Any]], instrument: str) -> dict[Attrs, Any]:
    """An instrument's points, without those that are 0 (an up-down counter back to 0, a
    counter never added to does not appear at all)."""
    return {k: v for k, v in points.get(instrument, {}).items() if v != 0}


def hist_counts(points: dict[str, dict[Attrs, Any]], instrument: str) -> dict[Attrs, int]:
    return {k: v[0] for k, v in points.get(instrument, {}).items()}


@pytest.fixture
def otel() -> Iterator[Telemetry]:
    t = Telemetry()
    try:
        yield t
    finally:
        pglock.configure_telemetry(enabled=False)
        t.meters.shutdown()
        t.tracers.shutdown()


@pytest.fixture
def admin(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection to the module's database (the one with the pglock schema)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def known_wait(otel: Telemetry, held: Any, waiter: Any, seconds: float, kind: str) -> None:
    """``waiter.acquire()`` in a thread while ``held`` holds the lock; once the waiters
    counter shows it waiting, ``held`` is released ``seconds`` later: the wait lasted at
    least that long. ``waiter`` is released afterwards."""
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    assert wait_until(
        lambda: counts(otel.points(probe=True), "pglock.lock.waiters") == {a(kind): 1}, 20
    )
    time.sleep(seconds)
    held.release()
    thread.join(20)
    assert got == [True]
    waiter.release()


# --- off ---------------------------------------------------------------------------------------


def test_off_means_the_lock_methods_are_the_classes_own(otel: Telemetry) -> None:
    from pglock._lease import Lease
    from pglock._semaphore import Semaphore

    own = (_advisory.PgLock.__dict__["_acquire"], _advisory.PgLock.__dict__["release"],
           Lease.__dict__["release"], Semaphore.__dict__["_take"], _xact.xact_acquire)
    assert "_renew_failed" not in Lease.__dict__ and not _telemetry.installed()
    otel.configure()
    assert _telemetry.installed()
    assert _advisory.PgLock.__dict__["_acquire"] is not own[0]
    assert _xact.xact_acquire is not own[4]
    otel.configure(name_label=str)  # again: the settings change, the wrappers stay one layer
    assert _advisory.PgLock.__dict__["_acquire"].__wrapped__ is own[0]
    pglock.configure_telemetry(enabled=False)
    assert not _telemetry.installed()
    assert (_advisory.PgLock.__dict__["_acquire"], _advisory.PgLock.__dict__["release"],
            Lease.__dict__["release"], Semaphore.__dict__["_take"], _xact.xact_acquire) == own
    assert "_renew_failed" not in Lease.__dict__  # inherited again from Held


def test_disabled_records_nothing_more(otel: Telemetry, conn: psycopg.Connection[Any],
                                       name: str) -> None:
    otel.configure()
    with pglock.pg_lock(conn, name):
        pass
    pglock.configure_telemetry(enabled=False)
    with pglock.pg_lock(conn, name):
        pass
    assert counts(otel.points(), "pglock.lock.acquisitions") == {a("advisory"): 1}
    assert len(otel.spans()) == 1


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="enabled"):
        pglock.configure_telemetry(enabled=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name_label"):
        pglock.configure_telemetry(name_label="job")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="span_threshold"):
        pglock.configure_telemetry(span_threshold="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="span_threshold"):
        pglock.configure_telemetry(span_threshold=-1.0)
    assert not _telemetry.installed()


# --- advisory locks ----------------------------------------------------------------------------


def test_advisory_acquisition_timeout_and_known_wait(
    otel: Telemetry, conn: psycopg.Connection[Any], other: psycopg.Connection[Any], name: str
) -> None:
    otel.configure()
    with pglock.pg_lock(conn, name):  # one acquisition, uncontended
        pass
    held = pglock.pg_lock(other, name)
    assert held.acquire()
    # one timeout: fail-fast against `other`
    with pytest.raises(pglock.LockNotAcquired), pglock.pg_lock(conn, name, timeout=0):
        pass
    # a known wait, seen by the waiters counter: `held` is released 0.3 s after that
    known_wait(otel, held, pglock.pg_lock(conn, name), 0.3, "advisory")

    points = otel.points()
    assert counts(points, "pglock.lock.waiters") == {}  # and is back to 0
    assert counts(points, "pglock.lock.acquisitions") == {a("advisory"): 3}
    assert counts(points, "pglock.lock.timeouts") == {a("advisory"): 1}
    assert "pglock.lock.losses" not in points and "pglock.lock.deadlocks" not in points
    waits = points["pglock.lock.wait.duration"]
    assert hist_counts(points, "pglock.lock.wait.duration") == {
        a("advisory", outcome="acquired"): 3, a("advisory", outcome="timeout"): 1,
    }
    assert waits[a("advisory", outcome="acquired")][1] >= 0.3
    assert hist_counts(points, "pglock.lock.hold.duration") == {a("advisory"): 3}
    assert points["pglock.lock.hold.duration"][a("advisory")][1] >= 0.3  # `held`'s hold

    spans = otel.spans("pglock.lock.wait")
    assert [s.attributes["pglock.outcome"] for s in spans] == [
        "acquired", "acquired", "timeout", "acquired"
    ]
    assert len(otel.spans()) == 4
    for s in spans:
        assert s.attributes["pglock.lock.kind"] == "advisory"
        assert s.attributes["pglock.lock.name"] == name
        assert s.attributes["pglock.lock.key"] == pglock.key(name)
        assert s.status.status_code is StatusCode.UNSET
    assert spans[-1].end_time - spans[-1].start_time >= 0.3e9  # the real start time


def test_advisory_loss(otel: Telemetry, conn: psycopg.Connection[Any], name: str) -> None:
    otel.configure()
    lock = pglock.pg_lock(conn, name)
    assert lock.acquire()
    conn.execute("SELECT pg_advisory_unlock_all()")  # behind pglock's back
    with pytest.raises(pglock.LockLost):
        lock.release()
    points = otel.points()
    assert counts(points, "pglock.lock.losses") == {a("advisory"): 1}
    assert hist_counts(points, "pglock.lock.hold.duration") == {a("advisory"): 1}


def test_deadlock(otel: Telemetry, connect: Callable[..., psycopg.Connection[Any]],
                  name: str) -> None:
    c1, c2 = connect(), connect()
    for c in (c1, c2):
        c.execute("SET deadlock_timeout = '50ms'")
    otel.configure()
    first, second = pglock.pg_lock(c1, f"{name}:1"), pglock.pg_lock(c2, f"{name}:2")
    assert first.acquire() and second.acquire()
    outcomes: list[str] = []

    def cross(c: psycopg.Connection[Any], other_name: str) -> None:
        lock = pglock.pg_lock(c, other_name)
        try:
            lock.acquire()
        except pglock.DeadlockDetected:
            outcomes.append("deadlock")
            # The survivor gets its lock once this side lets go.
            (first if c is c1 else second).release()
        else:
            outcomes.append("acquired")
            lock.release()

    threads = [threading.Thread(target=cross, args=(c1, f"{name}:2")),
               threading.Thread(target=cross, args=(c2, f"{name}:1"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == ["acquired", "deadlock"]
    for lock in (first, second):
        if lock.locked:
            lock.release()

    points = otel.points()
    assert counts(points, "pglock.lock.deadlocks") == {a("advisory"): 1}
    assert counts(points, "pglock.lock.acquisitions") == {a("advisory"): 3}
    assert hist_counts(points, "pglock.lock.wait.duration") == {
        a("advisory", outcome="acquired"): 3, a("advisory", outcome="deadlock"): 1,
    }
    assert counts(points, "pglock.lock.waiters") == {}
    (dead,) = [s for s in otel.spans() if s.attributes["pglock.outcome"] == "deadlock"]
    assert dead.status.status_code is StatusCode.ERROR
    assert [e.name for e in dead.events] == ["exception"]


def test_xact_lock(otel: Telemetry, conn: psycopg.Connection[Any],
                   other: psycopg.Connection[Any], name: str) -> None:
    otel.configure()
    with conn.transaction():
        pglock.xact_lock(conn, name)
        with other.transaction():
            assert not pglock.try_xact_lock(other, name)
    points = otel.points()
    assert counts(points, "pglock.lock.acquisitions") == {a("xact"): 1}
    assert counts(points, "pglock.lock.timeouts") == {a("xact"): 1}
    assert "pglock.lock.hold.duration" not in points  # it ends at commit, unseen by pglock
    assert [s.attributes["pglock.lock.kind"] for s in otel.spans()] == ["xact", "xact"]


# --- kinds built on session locks: recorded once, under their own kind ---------------------------


def test_pool_rwlock_and_singleton_record_their_own_kind(
    otel: Telemetry, pg_dsn: str, conn: psycopg.Connection[Any], name: str
) -> None:
    otel.configure()
    with ConnectionPool(pg_dsn, min_size=1, max_size=2, open=True) as pool:
        with pglock.pool_lock(pool, name):
            pass
        rw = pglock.rwlock(pool, f"{name}:rw")
        with rw.read():
            pass
        with pglock.rwlock(conn, f"{name}:rw").write():
            pass
        assert pglock.singleton(pool, f"{name}:job")(lambda: 7)() == 7
    points = otel.points()
    assert counts(points, "pglock.lock.acquisitions") == {a("pool"): 1, a("rwlock"): 3}
    assert hist_counts(points, "pglock.lock.hold.duration") == {a("pool"): 1, a("rwlock"): 3}
    assert hist_counts(points, "pglock.lock.wait.duration") == {
        a("pool", outcome="acquired"): 1, a("rwlock", outcome="acquired"): 3,
    }
    assert counts(points, "pglock.lock.waiters") == {}
    kinds = [s.attributes["pglock.lock.kind"] for s in otel.spans()]
    assert kinds == ["pool", "rwlock", "rwlock", "rwlock"]


# --- leases, semaphores, leaders ---------------------------------------------------------------


def test_lease_acquisition_timeout_and_loss_at_release(
    otel: Telemetry, dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    otel.configure()
    with pglock.lease(dsn, name, ttl=30, holder="h1") as lease:
        token = lease.token
        with pytest.raises(pglock.LockNotAcquired), pglock.lease(dsn, name, timeout=0,
                                                                  holder="h2"):
            pass
    lost = pglock.lease(dsn, name, ttl=30, holder="h3", keepalive=False)
    assert lost.acquire()
    admin.execute("DELETE FROM pglock.lease WHERE name = %s", (name,))
    with pytest.raises(pglock.LockLost):
        lost.release()

    points = otel.points()
    assert counts(points, "pglock.lock.acquisitions") == {a("lease"): 2}
    assert counts(points, "pglock.lock.timeouts") == {a("lease"): 1}
    assert counts(points, "pglock.lock.losses") == {a("lease"): 1}
    assert hist_counts(points, "pglock.lock.hold.duration") == {a("lease"): 2}
    assert counts(points, "pglock.lock.waiters") == {}
    waits = otel.spans("pglock.lock.wait")
    assert [(s.attributes["pglock.outcome"], s.attributes["pglock.lock.holder"]) for s in waits] \
        == [("acquired", "h1"), ("timeout", "h2"), ("acquired", "h3")]
    assert waits[0].attributes["pglock.lock.token"] == token
    (gone,) = otel.spans("pglock.lease.lost")
    assert gone.attributes["pglock.lock.name"] == name
    assert gone.attributes["pglock.lock.holder"] == "h3"
    assert gone.attributes["pglock.lock.token"] == lost.token


def test_lease_lost_by_the_keepalive_is_counted_once(
    otel: Telemetry, dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    otel.configure()
    lease = pglock.lease(dsn, name, ttl=0.6, holder="h1")
    assert lease.acquire()
    admin.execute("DELETE FROM pglock.lease WHERE name = %s", (name,))
    assert wait_until(lambda: lease.lost, 10)  # the next renewal finds it gone
    with pytest.raises(pglock.LockLost):
        lease.release()
    points = otel.points()
    assert counts(points, "pglock.lock.losses") == {a("lease"): 1}
    assert hist_counts(points, "pglock.lock.hold.duration") == {a("lease"): 1}
    (gone,) = otel.spans("pglock.lease.lost")
    assert "no longer held" in gone.attributes["pglock.lost.reason"]


def _fail_a_renewal(otel: Telemetry, dsn: str, lease: pglock.Lease) -> None:
    """Lock the lease table until a keepalive span ends (renewals cannot run), then release."""
    with psycopg.connect(dsn) as blocker:  # renewals cannot run while it locks the table
        blocker.execute("LOCK TABLE pglock.lease IN ACCESS EXCLUSIVE MODE")
        assert wait_until(lambda: otel.spans("pglock.lease.keepalive"), 10)
        blocker.rollback()
    with contextlib.suppress(pglock.LockLost):  # a renewal may or may not come in time
        lease.release()


def test_lease_keepalive_failure_makes_a_span(
    otel: Telemetry, dsn: str, name: str
) -> None:
    otel.configure()
    lease = pglock.lease(dsn, name, ttl=1.0, holder="h1")
    assert lease.acquire()
    _fail_a_renewal(otel, dsn, lease)
    span = otel.spans("pglock.lease.keepalive")[0]
    assert span.attributes["pglock.lock.name"] == name
    assert span.attributes["pglock.lock.holder"] == "h1"
    assert span.attributes["pglock.lock.token"] == lease.token
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"]


def test_semaphore(otel: Telemetry, dsn: str, admin: psycopg.Connection[Any], name: str) -> None:
    otel.configure()
    sem, rival = pglock.semaphore(dsn, name, 1), pglock.semaphore(dsn, name, 1)
    with sem.hold() as permit:
        assert not rival.acquire(timeout=0)
        holder = permit.holder
    assert sem.acquire()
    admin.execute("DELETE FROM pglock.semaphore_permit WHERE semaphore = %s", (name,))
    with pytest.raises(pglock.LockLost):
        sem.release()  # a lost permit is counted at its release
    points = otel.points()
    assert counts(points, "pglock.lock.acquisitions") == {a("semaphore"): 2}
    assert counts(points, "pglock.lock.timeouts") == {a("semaphore"): 1}
    assert counts(points, "pglock.lock.losses") == {a("semaphore"): 1}
    assert hist_counts(points, "pglock.lock.hold.duration") == {a("semaphore"): 2}
    assert counts(points, "pglock.lock.waiters") == {}
    first = otel.spans("pglock.lock.wait")[0]
    assert first.attributes["pglock.lock.holder"] == holder
    assert first.attributes["pglock.lock.name"] == name


def test_leader(otel: Telemetry, pg_dsn: str, name: str) -> None:
    otel.configure()
    with pglock.leader(pg_dsn, name, check_interval=0.2) as election:
        assert election.wait_elected(20)
    points = otel.points()
    assert counts(points, "pglock.lock.acquisitions") == {a("leader"): 1}
    assert hist_counts(points, "pglock.lock.hold.duration") == {a("leader"): 1}
    assert "pglock.lock.losses" not in points  # resigning is no loss
    (span,) = otel.spans()
    assert span.attributes["pglock.lock.kind"] == "leader"
    assert span.attributes["pglock.lock.key"] == pglock.key(name)


# --- settings ----------------------------------------------------------------------------------


def test_no_name_on_metrics_by_default_a_mappers_label_otherwise(
    otel: Telemetry, conn: psycopg.Connection[Any], name: str
) -> None:
    otel.configure()
    with pglock.pg_lock(conn, f"{name}:123456"):
        pass
    assert counts(otel.points(), "pglock.lock.acquisitions") == {a("advisory"): 1}
    assert otel.spans()[0].attributes["pglock.lock.name"] == f"{name}:123456"  # spans: always

    otel.configure(name_label=lambda n: n.rsplit(":", 1)[0] if n.endswith("6") else None)
    with pglock.pg_lock(conn, f"{name}:123456"):
        pass
    with pglock.pg_lock(conn, f"{name}:7"):  # the mapper says None: no name attribute
        pass
    # a new configuration keeps the provider's instruments: the points add up
    assert counts(otel.points(), "pglock.lock.acquisitions") == {
        a("advisory"): 2, a("advisory", label=name): 1,
    }


def test_a_raising_name_label_never_fails_the_lock(
    otel: Telemetry, conn: psycopg.Connection[Any], name: str
) -> None:
    otel.configure(name_label=lambda n: 1 / 0)  # type: ignore[arg-type,return-value]
    with pglock.pg_lock(conn, name):
        pass
    assert counts(otel.points(), "pglock.lock.acquisitions") == {a("advisory"): 1}


class _BrokenProcessor(SpanProcessor):
    """An application's span processor with a bug: it raises on every span."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise RuntimeError("a span processor's bug")

    def on_end(self, span: Any) -> None:
        raise RuntimeError("a span processor's bug")


def test_a_failing_span_processor_never_changes_a_locks_outcome(
    otel: Telemetry, conn: psycopg.Connection[Any], other: psycopg.Connection[Any], name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = TracerProvider()
    broken.add_span_processor(_BrokenProcessor())
    pglock.configure_telemetry(meter_provider=otel.meters, tracer_provider=broken)
    caplog.set_level(logging.DEBUG, logger="pglock.telemetry")
    try:
        lock = pglock.pg_lock(conn, name)
        assert lock.acquire() is True  # granted and said so, not the processor's error
        assert lock.locked
        assert other.execute("SELECT pg_try_advisory_lock(%s)", (pglock.key(name),)).fetchone() \
            == (False,)
        # A timeout is still a timeout.
        with pytest.raises(pglock.LockNotAcquired), pglock.pg_lock(other, name, timeout=0):
            pass
        lock.release()
        assert not lock.locked
        assert conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone() == (0,)
    finally:
        broken.shutdown()
    points = otel.points()  # the metrics, recorded before the spans failed, are all there
    assert counts(points, "pglock.lock.acquisitions") == {a("advisory"): 1}
    assert counts(points, "pglock.lock.timeouts") == {a("advisory"): 1}
    failed = [r for r in caplog.records if "recording failed" in r.getMessage()]
    assert len(failed) == 2 and failed[0].levelno == logging.WARNING
    assert all(r.levelno == logging.DEBUG for r in failed[1:])


def test_span_threshold(otel: Telemetry, conn: psycopg.Connection[Any],
                        other: psycopg.Connection[Any], name: str) -> None:
    otel.configure(span_threshold=1.0)
    with pglock.pg_lock(conn, name):  # uncontended: far below the threshold
        pass
    assert otel.spans() == []
    held = pglock.pg_lock(other, name)
    assert held.acquire()
    known_wait(otel, held, pglock.pg_lock(conn, name), 1.2, "advisory")
    (span,) = otel.spans()
    assert span.end_time - span.start_time >= 1.0e9
    # metrics record every wait whatever the threshold
    assert counts(otel.points(), "pglock.lock.acquisitions") == {a("advisory"): 3}


def test_a_wait_span_is_a_child_of_the_callers_span(
    otel: Telemetry, conn: psycopg.Connection[Any], name: str
) -> None:
    otel.configure()
    tracer = otel.tracers.get_tracer("app")
    with tracer.start_as_current_span("request") as request, pglock.pg_lock(conn, name):
        pass
    wait = otel.spans("pglock.lock.wait")[0]
    assert wait.parent is not None
    assert wait.parent.span_id == request.get_span_context().span_id
    assert wait.context.trace_id == request.get_span_context().trace_id


# --- a slow or failing exporter, span processor, exemplar filter or name_label ------------------
# Such code of the application's runs on pglock's telemetry thread only: a lock call, the
# keepalive and on_lost never wait for it, and nothing it raises reaches them.


class Plugin:
    """The application's code that telemetry runs. ``block``: waits until :meth:`release`
    (``entered`` says it is waiting; after BOUND s it gives up, sets ``gave_up`` and waits no
    more); ``raise``: raises RuntimeError; ``raise-base``: a BaseException (the CancelledError of
    an exporter built on asyncio). Released, it does nothing. ``threads``: where it ran."""

    BOUND = 30.0

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gave_up = False
        self.threads: set[str] = set()

    def __call__(self) -> None:
        self.threads.add(threading.current_thread().name)
        if self.gate.is_set():
            return
        if self.behaviour == "raise":
            raise RuntimeError("the application's telemetry plugin failed")
        if self.behaviour == "raise-base":
            raise asyncio.CancelledError()
        if not self.gave_up:
            self.entered.set()
            self.gave_up = not self.gate.wait(self.BOUND)

    def release(self) -> None:
        self.gate.set()

    def still_blocking(self) -> bool:
        return self.entered.is_set() and not self.gate.is_set() and not self.gave_up


class PluginExporter(SpanExporter):
    def __init__(self, plugin: Plugin) -> None:
        self.plugin = plugin

    def export(self, spans: Any) -> SpanExportResult:
        self.plugin()
        return SpanExportResult.SUCCESS


class PluginProcessor(SpanProcessor):
    def __init__(self, plugin: Plugin) -> None:
        self.plugin = plugin

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.plugin()

    def on_end(self, span: Any) -> None:
        self.plugin()


WHERE = ("exporter", "processor", "exemplar_filter", "name_label")


@pytest.fixture
def hostile() -> Iterator[Callable[[str, Plugin], Telemetry]]:
    """``hostile(where, plugin)``: pglock's telemetry on with ``plugin`` as a SimpleSpanProcessor's
    exporter, a span processor, the MeterProvider's exemplar filter or the name_label. The
    plugin is released before telemetry is turned off (which waits for what was queued)."""
    made: list[tuple[Telemetry, Plugin]] = []

    def make(where: str, plugin: Plugin, **settings: Any) -> Telemetry:
        processors: list[SpanProcessor] = []
        meter_options: dict[str, Any] = {}
        if where == "exporter":
            processors.append(SimpleSpanProcessor(PluginExporter(plugin)))
        elif where == "processor":
            processors.append(PluginProcessor(plugin))
        elif where == "exemplar_filter":
            if "exemplar_filter" not in inspect.signature(MeterProvider).parameters:
                pytest.skip("this opentelemetry-sdk has no exemplar filter (1.26+)")
            from opentelemetry.sdk.metrics import ExemplarFilter

            class PluginFilter(ExemplarFilter):
                def should_sample(self, *args: Any) -> bool:
                    plugin()
                    return False

            meter_options["exemplar_filter"] = PluginFilter()
        else:
            settings["name_label"] = lambda name: plugin()
        t = Telemetry(processors, **meter_options)
        made.append((t, plugin))
        t.configure(**settings)
        return t

    try:
        yield make
    finally:
        for _, plugin in made:
            plugin.release()
        pglock.configure_telemetry(enabled=False)
        for t, _ in made:
            t.meters.shutdown()
            t.tracers.shutdown()


def every_kind(dsn: str, conn: psycopg.Connection[Any], other: psycopg.Connection[Any],
               admin: psycopg.Connection[Any], pool: ConnectionPool[Any], name: str) -> list[Any]:
    """Each kind of lock acquired and released, a rival refused meanwhile: what every call
    returned, and what Postgres says at each step."""

    def held(n: str) -> Any:
        return admin.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND (classid::bigint << 32) | objid::bigint = %s", (pglock.key(n),)
        ).fetchone()

    def rows(query: str, n: str) -> Any:
        return admin.execute(query, (n,)).fetchone()

    leases = "SELECT count(*) FROM pglock.lease WHERE name = %s"
    permits = "SELECT count(*) FROM pglock.semaphore_permit WHERE semaphore = %s"

    seen: list[Any] = []
    n = f"{name}:pg"
    lock = pglock.pg_lock(conn, n)
    seen += [lock.acquire(), lock.locked, held(n), pglock.pg_lock(other, n).acquire(timeout=0)]
    lock.release()
    seen += [lock.locked, held(n)]
    n = f"{name}:xact"
    with conn.transaction():
        pglock.xact_lock(conn, n)
        seen.append(held(n))
        with other.transaction():
            seen.append(pglock.try_xact_lock(other, n))
    seen.append(held(n))
    n = f"{name}:pool"
    with pglock.pool_lock(pool, n):
        seen += [held(n), pglock.pg_lock(other, n).acquire(timeout=0)]
    seen.append(held(n))
    n = f"{name}:lease"
    lease = pglock.lease(dsn, n, ttl=30)
    seen += [lease.acquire(), lease.locked, rows(leases, n)]
    seen.append(pglock.lease(dsn, n, ttl=30).acquire(timeout=0))
    lease.release()
    seen += [lease.locked, rows(leases, n)]
    n = f"{name}:sem"
    sem = pglock.semaphore(dsn, n, 1)
    seen += [bool(sem.acquire()), rows(permits, n)]
    seen.append(bool(pglock.semaphore(dsn, n, 1).acquire(timeout=0)))
    sem.release()
    seen.append(rows(permits, n))
    return seen


#: every_kind() with telemetry off: granted, held in Postgres, the rival refused, released.
EVERY_KIND = [
    True, True, (1,), False, False, (0,),  # pg_lock
    (1,), False, (0,),  # xact_lock, try_xact_lock
    (1,), False, (0,),  # pool_lock
    True, True, (1,), False, False, (0,),  # lease
    True, (1,), False, (0,),  # semaphore
]


@pytest.fixture
def pool(pg_dsn: str, app_name: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(pg_dsn, min_size=1, max_size=1, open=True,
                        kwargs={"application_name": app_name}) as p:
        yield p


@pytest.mark.timeout(120)  # on 8f1836e a blocking plugin holds the test's own thread for BOUND
@pytest.mark.parametrize("where", WHERE)
def test_every_lock_call_returns_while_the_telemetry_plugin_blocks(
    hostile: Callable[..., Telemetry], where: str, dsn: str, conn: psycopg.Connection[Any],
    other: psycopg.Connection[Any], admin: psycopg.Connection[Any], pool: ConnectionPool[Any],
    name: str,
) -> None:
    off = every_kind(dsn, conn, other, admin, pool, f"{name}:off")
    assert off == EVERY_KIND
    plugin = Plugin("block")
    otel = hostile(where, plugin)
    with pglock.pg_lock(conn, f"{name}:first"):  # its recording makes the plugin block
        pass
    assert plugin.entered.wait(20)
    # The proof: every call below returns, with the outcome it has with telemetry off, while
    # the plugin is still blocked.
    assert every_kind(dsn, conn, other, admin, pool, f"{name}:on") == off
    assert plugin.still_blocking()
    plugin.release()

    points = otel.points()  # flushes: everything queued meanwhile is recorded now
    assert counts(points, "pglock.lock.acquisitions") == {
        a("advisory"): 2, a("xact"): 1, a("pool"): 1, a("lease"): 1, a("semaphore"): 1,
    }
    assert counts(points, "pglock.lock.timeouts") == {
        a("advisory"): 2, a("xact"): 1, a("lease"): 1, a("semaphore"): 1,
    }
    assert hist_counts(points, "pglock.lock.hold.duration") == {
        a("advisory"): 2, a("pool"): 1, a("lease"): 1, a("semaphore"): 1,
    }
    assert counts(points, "pglock.lock.waiters") == {}
    assert len(otel.spans("pglock.lock.wait")) == 11
    assert plugin.threads == {"pglock-telemetry"}


@pytest.mark.parametrize("behaviour", ["raise", "raise-base"])
@pytest.mark.parametrize("where", WHERE)
def test_a_raising_telemetry_plugin_changes_no_outcome(
    hostile: Callable[..., Telemetry], where: str, behaviour: str, dsn: str,
    conn: psycopg.Connection[Any], other: psycopg.Connection[Any],
    admin: psycopg.Connection[Any], pool: ConnectionPool[Any], name: str,
) -> None:
    off = every_kind(dsn, conn, other, admin, pool, f"{name}:off")
    assert off == EVERY_KIND
    plugin = Plugin(behaviour)
    otel = hostile(where, plugin)
    assert every_kind(dsn, conn, other, admin, pool, f"{name}:on") == off
    before = otel.points()
    plugin.release()  # it works again: the telemetry thread goes on recording
    with pglock.pg_lock(conn, name):
        pass
    acquired = counts(otel.points(), "pglock.lock.acquisitions").get(a("advisory"), 0)
    assert acquired == counts(before, "pglock.lock.acquisitions").get(a("advisory"), 0) + 1
    assert otel.spans()[-1].attributes["pglock.lock.name"] == name
    assert plugin.threads == {"pglock-telemetry"}


def lease_expiry(admin: psycopg.Connection[Any], name: str) -> Any:
    row = admin.execute("SELECT expires_at FROM pglock.lease WHERE name = %s", (name,)).fetchone()
    return None if row is None else row[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["exporter", "processor"])
def test_a_stuck_exporter_delays_no_renewal(
    hostile: Callable[..., Telemetry], where: str, dsn: str, admin: psycopg.Connection[Any],
    name: str,
) -> None:
    """The issue's case: a lease lost in the keepalive makes a span; with its exporter stuck,
    another lease of the same source, healthy, must go on being renewed."""
    plugin = Plugin("block")
    otel = hostile(where, plugin, span_threshold=3600.0)  # no wait spans: only the loss's
    lost: list[Any] = []
    healthy = pglock.lease(dsn, f"{name}:healthy", ttl=1.0, on_lost=lost.append)
    doomed = pglock.lease(dsn, f"{name}:doomed", ttl=1.0)
    assert healthy.acquire() and doomed.acquire()
    admin.execute("DELETE FROM pglock.lease WHERE name = %s", (f"{name}:doomed",))
    assert plugin.entered.wait(20)  # the keepalive found it lost; its span is stuck
    first = lease_expiry(admin, f"{name}:healthy")
    # Several TTLs later in the database's own time, the healthy lease is still renewed.
    assert wait_until(
        lambda: lease_expiry(admin, f"{name}:healthy") >= first + timedelta(seconds=3.5), 30
    )
    assert healthy.locked and lost == [] and plugin.still_blocking()
    plugin.release()
    healthy.release()
    with pytest.raises(pglock.LockLost):
        doomed.release()
    (gone,) = otel.spans("pglock.lease.lost")
    assert gone.attributes["pglock.lock.name"] == f"{name}:doomed"
    assert counts(otel.points(), "pglock.lock.losses") == {a("lease"): 1}
    assert lost == [] and plugin.threads == {"pglock-telemetry"}


def test_a_keepalive_failure_is_recorded_on_the_telemetry_thread(
    hostile: Callable[..., Telemetry], dsn: str, name: str
) -> None:
    plugin = Plugin("ok")
    plugin.release()
    otel = hostile("processor", plugin, span_threshold=3600.0)
    lease = pglock.lease(dsn, name, ttl=1.0)
    assert lease.acquire()
    _fail_a_renewal(otel, dsn, lease)
    assert plugin.threads == {"pglock-telemetry"}


def test_a_full_queue_drops_and_counts_and_never_grows(
    hostile: Callable[..., Telemetry], monkeypatch: pytest.MonkeyPatch,
    conn: psycopg.Connection[Any], name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    queue = _keepalive._Callbacks("pglock-telemetry", 5)
    monkeypatch.setattr(_keepalive, "telemetry", queue)
    caplog.set_level(logging.DEBUG, logger="pglock.telemetry")
    plugin = Plugin("block")
    otel = hostile("exporter", plugin)
    with pglock.pg_lock(conn, f"{name}:first"):
        pass
    assert plugin.entered.wait(20)
    for _ in range(10):
        with pglock.pg_lock(conn, name) as lock:
            assert lock.locked
    assert len(queue.queue) == 5 and queue.dropped > 0  # bounded: the rest were dropped
    full = [r for r in caplog.records if "queue is full" in r.getMessage()]
    assert len(full) == queue.dropped
    assert full[0].levelno == logging.WARNING
    assert all(r.levelno == logging.DEBUG for r in full[1:])
    assert plugin.still_blocking()
    plugin.release()
    assert _telemetry.flush(20) and len(queue.queue) == 0
    spans = len(otel.spans())
    with pglock.pg_lock(conn, name):  # the queue has room again: recorded
        pass
    assert len(otel.spans()) == spans + 1
