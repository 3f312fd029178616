"""T13 (b) client clock skew: pglock never uses the client's wall clock for expiry.

The client's wall clock (``time.time``, ``time.time_ns``, ``datetime.now/utcnow/today``, in
``datetime`` and in every pglock module) is moved an hour forward, then an hour back, in
process. Leases and semaphore permits must behave exactly as with a correct clock, because
expiry is decided on the database clock (``clock_timestamp()``) and the client counts its own
deadline on ``time.monotonic()``:

* the grant's expiry is the server's, and the holder believes in it (neither lost at once, as
  wall-clock arithmetic would conclude an hour ahead, nor kept for an hour longer);
* a waiter is granted the lease after the holder's expiry on the database clock and not later
  than it would be anyway (woken by the expiry the server reported, with no spinning);
* the keepalive renews on its monotonic schedule; permits likewise.

Negative control: under the same patch, the wall-clock arithmetic a naive client would do
(``expires_at - datetime.now()``) is an hour off, so the patch is in force and the assertions
would catch a client that used it.

T13 (a), ``clock_timestamp()`` rather than ``now()``, is ``test_leases.py::test_T13_*`` and
``tests/integration/test_lease.py::test_expiry_is_computed_on_clock_timestamp_not_now``.
T13 (c), a jump of the *server's* clock, cannot be staged without faking the server's clock
(libfaketime); it is a documented limit (docs/guarantees.md).
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import throwaway_database, with_params
from _wire import RecordingConnection
from psycopg_pool import ConnectionPool

import pglock
from pglock import _lease

from .oracles import wait_for

pytestmark = pytest.mark.timeout(60)

HOUR = 3600.0


@pytest.fixture(scope="module")
def db(pg_dsn: str) -> Iterator[str]:
    with throwaway_database(pg_dsn, prefix="pglock_clock", install=True) as dsn:
        try:
            yield dsn
        finally:
            _lease.shutdown()


@pytest.fixture
def admin(db: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(db, autocommit=True, application_name="pglock-clock-admin") as c:
        yield c


def skew_wall_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Move this process's wall clock by ``seconds`` (the monotonic clock stays)."""
    real_time, real_time_ns = time.time, time.time_ns
    real_dt = datetime.datetime
    delta = datetime.timedelta(seconds=seconds)

    class Skewed(real_dt):  # type: ignore[misc, valid-type]
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return real_dt.now(tz) + delta

        @classmethod
        def utcnow(cls) -> Any:
            return real_dt.utcnow() + delta

        @classmethod
        def today(cls) -> Any:
            return real_dt.today() + delta

    monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
    monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + int(seconds * 1e9))
    monkeypatch.setattr(datetime, "datetime", Skewed)
    for modname, mod in list(sys.modules.items()):
        if modname.startswith("pglock") and getattr(mod, "datetime", None) is real_dt:
            monkeypatch.setattr(mod, "datetime", Skewed)


def lease_row(admin: psycopg.Connection[Any], name: str) -> Any:
    return admin.execute(
        "SELECT holder, token, expires_at, extract(epoch FROM expires_at - clock_timestamp())"
        " FROM pglock.lease WHERE name = %s",
        (name,),
    ).fetchone()


def permit_expiry(admin: psycopg.Connection[Any], name: str) -> Any:
    row = admin.execute(
        "SELECT expires_at, extract(epoch FROM expires_at - clock_timestamp())"
        " FROM pglock.semaphore_permit WHERE semaphore = %s",
        (name,),
    ).fetchone()
    assert row is not None
    return row


@pytest.mark.parametrize("skew", [HOUR, -HOUR], ids=["client-clock+1h", "client-clock-1h"])
def test_T13_client_wall_clock_an_hour_off_changes_nothing(
    db: str,
    app_name: str,
    name: str,
    skew: float,
    admin: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dsn = with_params(db, application_name=app_name)
    kwargs = {"autocommit": True}
    recorded = len(RecordingConnection.instances)
    with ConnectionPool(
        dsn, min_size=1, max_size=4, kwargs=kwargs, connection_class=RecordingConnection
    ) as pool:

        def acquires_sent() -> int:
            conns = RecordingConnection.instances[recorded:]
            return sum(".acquire(" in s for c in conns for s in c.sent)

        skew_wall_clock(monkeypatch, skew)
        server_now = admin.execute("SELECT clock_timestamp()").fetchone()
        assert server_now is not None
        # The patch is in force, for time and for datetime.
        wall = datetime.datetime.now(datetime.timezone.utc)
        assert abs((wall - server_now[0]).total_seconds() - skew) < 60
        assert abs(time.time() - server_now[0].timestamp() - skew) < 60

        kept = pglock.lease(pool, f"{name}:kept", ttl=2)  # keepalive on
        sem = pglock.semaphore(pool, f"{name}:sem", limit=1, ttl=2)
        a = pglock.lease(pool, name, ttl=0.5, keepalive=False)
        try:
            assert kept.acquire(timeout=0) and sem.acquire(timeout=0) and a.acquire(timeout=0)
            kept_first = lease_row(admin, f"{name}:kept")
            permit_first, permit_left = permit_expiry(admin, f"{name}:sem")
            assert 0 < permit_left <= 2

            # The holder believes the server's expiry, on its monotonic clock.
            assert a.locked
            a.check()
            holder, token, expires_at, left = lease_row(admin, name)
            assert (holder, token, expires_at) == (a.holder, a.token, a.expires_at)
            assert 0 < left <= 0.5
            # Negative control: wall-clock arithmetic under this patch is an hour off.
            naive = (expires_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
            assert abs(naive + skew) < 60

            # Another holder: refused now, granted after the expiry on the database clock,
            # woken by the expiry the server reported (not the 2-4 s fallback look, not an
            # hour late, no spinning on a wait computed from a wrong clock).
            b = pglock.lease(pool, name, ttl=5)
            assert b.acquire(timeout=0) is False
            sent = acquires_sent()
            assert b.acquire(timeout=10)
            acquires = acquires_sent() - sent
            assert b.acquired_at is not None and b.token is not None and a.token is not None
            assert expires_at <= b.acquired_at < expires_at + datetime.timedelta(seconds=1)
            assert b.token > a.token
            assert acquires <= 4, acquires
            assert not a.locked
            with pytest.raises(pglock.LockLost):
                a.check()
            b.release()

            # The keepalive renewed the other lease and the permits on its own schedule.
            wait_for(
                lambda: admin.execute(
                    "SELECT clock_timestamp() > %s", (permit_first,)
                ).fetchone()
                == (True,),
                what="the first permit expiry to pass on the database clock",
            )
            kept.check()
            row = lease_row(admin, f"{name}:kept")
            assert row[:2] == kept_first[:2] and row[2] > kept_first[2] and row[3] > 0
            again, again_left = permit_expiry(admin, f"{name}:sem")
            assert again > permit_first and again_left > 0
            assert pglock.semaphore(pool, f"{name}:sem", limit=1).acquire(timeout=0) is False
            sem.release()
            kept.release()
        finally:
            sem.close()
