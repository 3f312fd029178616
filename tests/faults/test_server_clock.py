"""T13 (c): a jump of the database server's clock (libfaketime on a throwaway cluster).

Lease and permit expiry is measured on the server's clock, so a jump of that clock changes it;
docs/guarantees.md states this limit. These tests show exactly what happens, and that fencing
limits the damage:

* **Forward, +1 h.** Every lease and permit expires at once on the server. Another holder is
  granted the lease immediately with a larger token; the old holder still believes it holds it
  until its next renewal (the documented window), but its ``guard()``ed write is refused, its
  ``extend()`` raises ``LockLost`` and its keepalive reports the loss. The old permit holder
  loses its permits the same way, and a new holder gets them.
* **Backward, -1 h.** Nothing expires early: the server keeps the lease for the hour (liveness
  suffers, safety does not): nobody else is granted it while the holder, which counts its TTL
  on its own monotonic clock, already considers it lost.

The cluster runs with ``LD_PRELOAD=libfaketime`` and a timestamp file that the test rewrites
(re-read on every clock call), the monotonic clock left alone. Skipped without the Debian
package ``libfaketime``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

import pglock
from pglock import _lease

from .cluster import Cluster, ClusterUnavailable
from .conftest import Bounds
from .oracles import wait_for

pytestmark = pytest.mark.timeout(90)

LIBFAKETIME = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
]


class FakeClockCluster:
    """A throwaway cluster whose wall clock is the real one plus :attr:`offset`."""

    def __init__(self, cluster: Cluster, stamp: Path) -> None:
        self.cluster = cluster
        self.stamp = stamp

    def jump(self, offset: str) -> None:
        """Set the server's clock offset (libfaketime syntax: ``+0``, ``+1h``, ``-1h``)."""
        tmp = self.stamp.with_suffix(".tmp")
        tmp.write_text(offset + "\n")
        os.chmod(tmp, 0o644)
        tmp.replace(self.stamp)  # atomic: a reader never sees an empty file


@pytest.fixture(scope="module")
def fake(request: pytest.FixtureRequest) -> Iterator[FakeClockCluster]:
    lib = next((p for p in LIBFAKETIME if Path(p).exists()), None)
    if lib is None:
        pytest.skip("libfaketime is not installed (Debian package libfaketime)")
    try:
        cluster = Cluster({"synchronous_commit": "on"}, prefix="pglock-clock-")
    except ClusterUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"no throwaway cluster under CI: {exc}", pytrace=False)
        pytest.skip(str(exc))
    try:
        fc = FakeClockCluster(cluster, cluster.dir / "faketime")
        fc.jump("+0")
        env = {
            "LD_PRELOAD": lib,
            "FAKETIME_TIMESTAMP_FILE": str(fc.stamp),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }
        with pytest.MonkeyPatch.context() as mp:  # only the server inherits it
            for k, v in env.items():
                mp.setenv(k, v)
            cluster.start()
        _install(cluster)
        yield fc
    finally:
        _lease.shutdown()
        cluster.destroy()


def _install(cluster: Cluster) -> None:
    from pglock import _schema

    _schema.install(cluster.dsn())


@pytest.fixture
def admin(fake: FakeClockCluster) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(fake.cluster.dsn(), autocommit=True, application_name="obs") as c:
        yield c


@pytest.fixture
def pool(fake: FakeClockCluster, app_name: str) -> Iterator[ConnectionPool[Any]]:
    dsn = fake.cluster.dsn(application_name=app_name)
    with ConnectionPool(dsn, min_size=1, max_size=6, kwargs={"autocommit": True}) as p:
        yield p
    fake.jump("+0")


def server_clock(admin: psycopg.Connection[Any]) -> Any:
    row = admin.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def test_T13_server_clock_jumps_forward_leases_expire_and_fencing_holds(
    fake: FakeClockCluster,
    pool: ConnectionPool[Any],
    admin: psycopg.Connection[Any],
    name: str,
    bounds: Bounds,
) -> None:
    admin.execute("CREATE TABLE IF NOT EXISTS fenced (name text PRIMARY KEY, token bigint)")
    lost = threading.Event()
    # `a` counts on its own deadline (5 s, no keepalive), so it still believes after the jump;
    # `k` is renewed every 0.5 s, and its keepalive is what reports the loss.
    a = pglock.lease(pool, name, ttl=5, keepalive=False)
    k = pglock.lease(pool, f"{name}:k", ttl=1.5, on_lost=lambda _lease: lost.set())
    sem = pglock.semaphore(pool, f"{name}:sem", limit=1, ttl=1.5)
    try:
        assert a.acquire(timeout=0) and k.acquire(timeout=0) and sem.acquire(timeout=0)
        assert a.token is not None
        # Control: before the jump nobody else gets any of them.
        assert pglock.lease(pool, name, timeout=0).acquire() is False
        assert pglock.semaphore(pool, f"{name}:sem", limit=1).acquire(timeout=0) is False

        before = server_clock(admin)
        fake.jump("+1h")
        t0 = time.monotonic()
        jumped = server_clock(admin)
        assert 3590 < (jumped - before).total_seconds() < 3700

        # At once: another holder is granted the lease, with a larger token.
        b = pglock.lease(pool, name, ttl=30)
        assert b.acquire(timeout=0)
        assert b.token is not None and b.token > a.token
        with psycopg.connect(fake.cluster.dsn()) as c, c.transaction():
            b.guard(c)
            c.execute("INSERT INTO fenced VALUES (%s, %s)", (name, b.token))
        # The old holder still believes it (until its deadline: the documented window)...
        assert a.locked and not a.lost
        # ... but the database refuses its fenced write, and its extend says lost.
        with (
            psycopg.connect(fake.cluster.dsn()) as c,
            pytest.raises(pglock.LockLost),
            c.transaction(),
        ):
            a.guard(c)
            c.execute("UPDATE fenced SET token = %s WHERE name = %s", (a.token, name))
        assert admin.execute("SELECT token FROM fenced WHERE name = %s", (name,)).fetchone() == (
            b.token,
        )
        assert a.lost and not a.locked
        with pytest.raises(pglock.LockLost):
            a.extend()
        # A renewed lease: its keepalive finds it gone at its next round (ttl/3).
        assert lost.wait(10)
        bounds.record("T13", "lease", "keepalive reports the loss after a +1 h server jump "
                      "(ttl 1.5 s)", time.monotonic() - t0)
        assert k.lost and not k.locked
        info = pglock.lease_info(admin, name)
        assert info is not None and (info.holder, info.token) == (b.holder, b.token)
        b.release()

        # The permit expired too: a new holder gets it, the old one hears LockLost.
        newcomer = pglock.semaphore(pool, f"{name}:sem", limit=1)
        assert newcomer.acquire(timeout=0)
        with pytest.raises(pglock.LockLost):
            sem.release()
        newcomer.release()
        newcomer.close()
    finally:
        fake.jump("+0")
        sem.close()
        admin.execute("DELETE FROM fenced WHERE name = %s", (name,))


def test_T13_server_clock_jumps_backward_leases_last_longer_never_shorter(
    fake: FakeClockCluster,
    pool: ConnectionPool[Any],
    admin: psycopg.Connection[Any],
    name: str,
) -> None:
    a = pglock.lease(pool, name, ttl=0.5, keepalive=False)
    try:
        assert a.acquire(timeout=0)
        fake.jump("-1h")
        # The holder's own belief ends at its monotonic deadline (0.5 s)...
        wait_for(lambda: not a.locked, timeout=5, what="the holder's local deadline")
        # ... and well past it, the server still keeps the lease for the hour: nobody else
        # is granted it (liveness, not safety).
        time.sleep(0.5)
        assert pglock.lease(pool, name, timeout=0).acquire() is False
        info = pglock.lease_info(admin, name)
        assert info is not None and info.holder == a.holder and info.expires_in > 3000
        # Back to the real clock: the lease is expired, and another holder gets it.
        fake.jump("+0")
        c = pglock.lease(pool, name, ttl=5)
        assert c.acquire(timeout=0)
        assert c.token is not None and a.token is not None and c.token > a.token
        c.release()
    finally:
        fake.jump("+0")
