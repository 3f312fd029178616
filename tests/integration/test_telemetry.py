"""OpenTelemetry metrics and spans (pglock.configure_telemetry, docs/observability.md).

Each test gives pglock an SDK MeterProvider with an in-memory reader and a TracerProvider with
an in-memory exporter (never the global providers), plays a scripted scenario against the real
server and checks every point and span it yields. Telemetry is off again after each test.
Waits are made by a holder that releases after a set time: sums are checked to be at least
that long, never bounded above.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from psycopg_pool import ConnectionPool
from test_lease_support import wait_until

import pglock
from pglock import _advisory, _telemetry, _xact

pytestmark = pytest.mark.timeout(60)


Attrs = frozenset[tuple[str, Any]]


class Telemetry:
    """An SDK meter and tracer provider with in-memory reader and exporter, given to pglock."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        # Read while a scenario runs (points(probe=True)), so that the final reading is the
        # reader's first: opentelemetry-sdk 1.20 (the lower bound) leaves out a cumulative
        # histogram point not updated since the reader's previous collection.
        self.probe = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader, self.probe])
        self.exporter = InMemorySpanExporter()
        self.tracers = TracerProvider()
        self.tracers.add_span_processor(SimpleSpanProcessor(self.exporter))

    def configure(self, **kwargs: Any) -> None:
        pglock.configure_telemetry(
            meter_provider=self.meters, tracer_provider=self.tracers, **kwargs
        )

    def points(self, *, probe: bool = False) -> dict[str, dict[Attrs, Any]]:
        """{instrument: {attributes: value}}; a histogram's value is (count, sum)."""
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


def test_lease_keepalive_failure_makes_a_span(
    otel: Telemetry, dsn: str, name: str
) -> None:
    otel.configure()
    lease = pglock.lease(dsn, name, ttl=1.0, holder="h1")
    assert lease.acquire()
    with psycopg.connect(dsn) as blocker:  # renewals cannot run while it locks the table
        blocker.execute("LOCK TABLE pglock.lease IN ACCESS EXCLUSIVE MODE")
        assert wait_until(lambda: otel.spans("pglock.lease.keepalive"), 10)
        blocker.rollback()
    with contextlib.suppress(pglock.LockLost):  # a renewal may or may not come in time
        lease.release()
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
