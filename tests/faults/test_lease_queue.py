"""Faults of the lease waiter queue (issue 13, revision pglock_0004), on a throwaway cluster.

A lease waiter (``timeout != 0``) queues a row in ``pglock.lease_waiter`` and refreshes its
liveness deadline (``alive_until``) while it waits; ``release()`` and expiry takeover grant the
lease to the live head of the queue in the same transaction, durably, and notify it alone. The
scenarios (numbered after the fault plan's T01-T28; T29 is reserved for failover):

T30 a waiter SIGKILLed at the head of the queue: the release grants past it (or to it,
    provisionally, and then past it once that grant expires); the next live waiter holds within
    2 s of the release.
T31 a waiter whose network goes silent at the head: as T30 for the others; when its network comes
    back it never believes in a grant it could not have seen in time.
T32 the holder SIGKILLed with three waiters queued: after its TTL the head of the queue takes it
    over (not any waiter), and the rest follow in arrival order.
T33 an immediate (crash) restart right after a handoff the waiter observed: the handoff's grant
    is still there (it committed durably before the waiter was told), while a plain release's
    commit, not durable by design, can be forgotten by the same restart (the negative control:
    this restart does forget what was not flushed). With three waiters queued across the restart,
    they reconnect and the queue drains in arrival order, tokens never going back.
T34 fairness: 50 waiters over 10 processes get the lease in arrival order.
T35 the T27 soak with queued lease waiters under its nemesis (kills, pauses, terminated backends,
    restarts): linearizable, no acknowledged update lost, no two sections at once, no violation
    of the grant history.

Oracles, in every scenario:

* **Grant history** (database truth): a trigger logs every change of ``pglock.lease`` rows
  (:func:`.oracles.install_lease_audit`). Tokens strictly rise from grant to grant; a grant ends
  before its expiry only by its own holder's process (a release, which may hand it on in the
  same transaction), never by anyone else; a new grant starts no earlier than the previous one
  ended or expired (:func:`.oracles.grant_violations`).
* **One believer at a time** (client truth): every waiter process logs, on the monotonic clock
  shared by all processes, when ``acquire()`` returned a grant, when its ``locked`` turned
  True or False (a 2 ms poller), when it called ``release()`` and when it was killed. The belief
  intervals of different grants never overlap.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pglock
from pglock import _schema, _waiting

from .cluster import Cluster
from .conftest import Bounds
from .linearizability import Op, check
from .oracles import (
    Grant,
    Oracle,
    grant_violations,
    install_lease_audit,
    lease_grants,
    wait_for,
)
from .procs import Holder
from .proxy import Proxy

# Grants must survive an immediate restart: commits are synchronous unless a statement says
# otherwise. The WAL writer sleeps long, so a commit that asked not to wait for its flush is
# really lost by an immediate restart (the negative control of T33); autovacuum off, so nothing
# else flushes it meanwhile.
CLUSTER_SETTINGS = {
    "synchronous_commit": "on",
    "max_connections": 150,
    "wal_writer_delay": "10s",
    "autovacuum": "off",
}

#: The bound on the stall a dead head waiter can cause after a release (issue 13: <= 2 s).
STALL_BOUND = 2.0


@pytest.fixture(scope="module")
def queue_db(cluster: Cluster) -> Cluster:
    _schema.install(cluster.dsn())
    with psycopg.connect(cluster.dsn(), autocommit=True) as c:
        row = c.execute("SELECT to_regclass('pglock.lease_waiter')").fetchone()
        if row is None or row[0] is None:
            pytest.skip("no lease waiter queue (revision pglock_0004) in this checkout")
        install_lease_audit(c)
    return cluster


@pytest.fixture
def obs(queue_db: Cluster) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(queue_db.dsn(), autocommit=True, application_name="pglock-obs") as c:
        yield c


class Run:
    """The processes of one scenario: each has its own application_name (``<app>:<tag>``) and
    holder ids ``<app>:<tag>#<waiter>``, so the grant history knows whose process ended what."""

    def __init__(
        self, cluster: Cluster, app: str, tmp: Path, holders: Callable[..., Holder]
    ) -> None:
        self.cluster = cluster
        self.app = app
        self.tmp = tmp
        self.holders = holders
        self.procs: dict[str, Holder] = {}
        self.paths: dict[str, Path] = {}
        self.killed: dict[str, float] = {}
        self.local: list[dict[str, Any]] = []  # events of leases held by the test process
        self.name = f"queue:{uuid.uuid4()}"  # the lease of the scenario

    def dsn(self, tag: str, port: int | None = None) -> str:
        return self.cluster.dsn(port=port, application_name=f"{self.app}:{tag}")

    def hid(self, tag: str, waiter: str = "0") -> str:
        return f"{self.app}:{tag}#{waiter}"

    def proc(self, tag: str) -> Holder:
        if tag not in self.procs:
            self.procs[tag] = self.holders()
            self.paths[tag] = self.tmp / f"{tag}.jsonl"
        return self.procs[tag]

    def wait(
        self, tag: str, waiter: str = "0", *, port: int | None = None, **kw: Any
    ) -> str:
        """Start a queued waiter (a :class:`holder.QueueWaiter`) in process ``tag``; ``wait`` is
        its acquire timeout (default 60 s), ``hold`` makes it release by itself."""
        holder = self.hid(tag, waiter)
        kw.setdefault("wait", 60)
        kw.setdefault("ttl", 10)
        self.proc(tag).request(
            "queue_wait", source=self.dsn(tag, port), name=self.name, holder=holder,
            history=str(self.paths[tag]), **kw,
        )
        return holder

    def release(self, holder: str) -> dict[str, Any]:
        tag = holder.split("#")[0].rsplit(":", 1)[1]
        return self.proc(tag).request("queue_release", holder=holder, check=False)

    def kill(self, tag: str) -> float:
        self.killed[tag] = self.procs[tag].kill()
        return self.killed[tag]

    def hold_here(self, name: str, tag: str = "H", ttl: float = 30) -> pglock.Lease:
        """A lease held by the test process (granted at once: the name is free)."""
        lease = pglock.lease(self.dsn(tag), name, ttl=ttl, holder=self.hid(tag))
        assert lease.acquire(timeout=0)
        self.local.append({"ev": "granted", "t": time.monotonic(), "holder": lease.holder,
                           "token": lease.token})
        return lease

    def release_here(self, lease: pglock.Lease) -> float:
        t = time.monotonic()
        self.local.append({"ev": "release", "t": t, "holder": lease.holder, "token": lease.token})
        lease.release()
        return t

    def events(self, tag: str | None = None) -> list[dict[str, Any]]:
        tags = [tag] if tag else list(self.paths)
        out: list[dict[str, Any]] = []
        for t in tags:
            path = self.paths[t]
            if path.exists():
                out += [json.loads(line) for line in path.read_text().splitlines() if line]
        return out

    def event(self, holder: str, ev: str, timeout: float = 30) -> dict[str, Any]:
        """The first ``ev`` event of ``holder`` (waits for it)."""
        tag = holder.split("#")[0].rsplit(":", 1)[1]

        def find() -> dict[str, Any] | None:
            return next(
                (e for e in self.events(tag) if e["holder"] == holder and e["ev"] == ev), None
            )

        found: dict[str, Any] = wait_for(
            find, timeout=timeout, interval=0.002, what=f"{ev} of {holder}"
        )
        return found

    def beliefs(self) -> list[tuple[float, float, str, int]]:
        """(start, end, holder, token) of every grant some handle believed in: from the first
        sign of it (``acquire()`` returned it, or ``locked`` turned True) to the first end
        (release() called, ``locked`` seen False: at its client deadline if that came first,
        the process killed). The poller's observations lag by a few ms; the other events are
        exact."""
        now = time.monotonic()
        spans: dict[tuple[str, int], list[float]] = {}
        for e in self.local + self.events():
            if e.get("token") is None:
                continue
            key = (e["holder"], e["token"])
            tag = e["holder"].split("#")[0].rsplit(":", 1)[1]
            span = spans.setdefault(key, [math.inf, self.killed.get(tag, now)])
            if e["ev"] in ("granted", "believes"):
                span[0] = min(span[0], e["t"])
            elif e["ev"] == "release":
                span[1] = min(span[1], e["t"])
            elif e["ev"] == "doubts":
                span[1] = min(span[1], e["t"], e.get("deadline") or math.inf)
        return sorted((a, b, h, t) for (h, t), (a, b) in spans.items() if a < math.inf)

    def assert_one_believer(self) -> None:
        intervals = self.beliefs()
        for a, b in itertools.pairwise(intervals):
            assert a[1] <= b[0], f"two handles believed they held the lease at once: {a} {b}"

    def app_of(self, holder: str) -> str:
        return holder.split("#")[0]


@pytest.fixture
def run(
    queue_db: Cluster, app_name: str, tmp_path: Path, holders: Callable[..., Holder]
) -> Run:
    return Run(queue_db, app_name, tmp_path, holders)


def queue(obs: psycopg.Connection[Any], name: str) -> list[str]:
    """Holders queued for ``name``, in queue order."""
    rows = obs.execute(
        "SELECT holder FROM pglock.lease_waiter WHERE name = %s ORDER BY id", (name,)
    ).fetchall()
    return [r[0] for r in rows]


def wait_queued(obs: psycopg.Connection[Any], name: str, holder: str) -> None:
    wait_for(lambda: holder in queue(obs, name), timeout=20, what=f"{holder} queued")


def assert_grant_history(obs: psycopg.Connection[Any], run: Run, name: str) -> list[Any]:
    grants = lease_grants(obs, name)
    assert grant_violations(grants, run.app_of) == []
    return grants


def lease_row(obs: psycopg.Connection[Any], name: str) -> tuple[Any, ...] | None:
    return obs.execute(
        "SELECT holder, token FROM pglock.lease WHERE name = %s", (name,)
    ).fetchone()


def test_grant_history_oracle_negative_controls() -> None:
    """The grant-history oracle on hand-made histories: it finds what it must (no database)."""
    app = lambda holder: holder.split("#")[0]  # noqa: E731
    fine = [Grant("a#1", 1, 0.0, 10.0, 1, 3.0, "a", 2), Grant("b#1", 2, 3.0, 9.0, 2)]
    assert grant_violations(fine, app) == []  # a's release handed it to b in one update
    taken = [Grant("a#1", 1, 0.0, 10.0, 1, 5.0, "b", 2), Grant("b#1", 2, 4.0, 9.0, 3)]
    assert len(grant_violations(taken, app)) == 2  # b ended a's live grant and overlapped it
    expired = [Grant("a#1", 1, 0.0, 4.0, 1, 5.0, "b", 2), Grant("b#1", 2, 5.0, 9.0, 3)]
    assert grant_violations(expired, app) == []  # a takeover after the expiry
    back = [Grant("a#1", 5, 0.0, 1.0, 1), Grant("b#1", 4, 2.0, 3.0, 2)]
    assert grant_violations(back, app) == ["token went back or repeated: 5 then 4"]


def test_T35_model_negative_controls(tmp_path: Path) -> None:
    """T35's lease model and quiet-grant oracle on hand-made histories (no database): a waiter
    (process 2) handed the lease at 0.05 s that gives up at 0.5 s while a try-lock (process 3)
    fails at 0.1 s. With a plain False the history is not linearizable and the grant log's grant
    to process 2 is flagged; with a ``why`` (pglock said the outcome is open) both accept it."""

    def history(why: str | None) -> list[Path]:
        runs = {
            "a": [("1", "acquire", "invoke", 0.0), ("1", "acquire", "ok", 0.01),
                  ("1", "release", "invoke", 0.02), ("1", "release", "ok", 0.03)],
            "b": [("2", "acquire", "invoke", 0.04), ("2", "acquire", "fail", 0.5)],
            "c": [("3", "acquire", "invoke", 0.1), ("3", "acquire", "fail", 0.11)],
        }
        paths = []
        for tag, events in runs.items():
            path = tmp_path / f"{tag}-{why}.jsonl"
            lines = [{"p": p, "name": "n", "f": f, "ev": ev, "t": t, "op": f"{p}:1",
                      "acked": True, "why": why if p == "2" else None}
                     for p, f, ev, t in events]
            path.write_text("".join(json.dumps(e) + "\n" for e in lines))
            paths.append(path)
        return paths

    grants = [Grant("app:S0#1:1", 1, 0.0, 1.0, 1, 0.03, "app:S0", 2),
              Grant("app:S1#2:1", 2, 0.05, 1.05, 2, 0.49, "app:S1", 3)]
    plain, said = history(None), history("its place in the queue was gone as it gave up")
    assert not check(load_lease_history(plain)[0]["n"])
    assert quiet_grants(plain, grants) == grants[1:]
    assert check(load_lease_history(said)[0]["n"])
    assert quiet_grants(said, grants) == []


def test_T35_a_waiter_takes_at_its_deadline_a_grant_whose_notify_it_missed(
    queue_db: Cluster, obs: psycopg.Connection[Any], app_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What T35 found, made deterministic: another process's release hands the lease to a
    waiter whose NOTIFY goes unheard (its listener terminated, its process paused: dropped
    here) and whose timeout ends before its first heartbeat. At its deadline the waiter must
    take the grant made to it, not pass it on and return False."""
    monkeypatch.setattr(_waiting.waiters, "on_notify", lambda lst, payload: None)
    name, dsn = f"quiet:{uuid.uuid4()}", queue_db.dsn(application_name=f"{app_name}:Q")
    first = pglock.lease(dsn, name, ttl=30, keepalive=False)
    assert first.acquire(timeout=0)
    waiter = pglock.lease(dsn, name, ttl=30)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=0.25)))
    thread.start()
    wait_queued(obs, name, waiter.holder)
    obs.execute(  # another process's release: no local handover either
        "SELECT * FROM pglock.release_v4(%s, %s, %s)", (name, first.holder, first.token)
    )
    handed = lease_row(obs, name)
    thread.join(10)
    assert got == [True], waiter._why_not
    assert handed == (waiter.holder, waiter.token) == lease_row(obs, name)
    waiter.release()
    assert lease_row(obs, name) is None


# --- T30 -----------------------------------------------------------------------------------


def test_T30_waiter_killed_at_the_head_is_skipped_within_the_bound(
    run: Run, obs: psycopg.Connection[Any], bounds: Bounds
) -> None:
    """W1 (head) is SIGKILLed just before the release, so the database still counts it live:
    the release may grant it the lease provisionally. W2 must hold within 2 s of the release
    all the same, and W1's grant (if any) must have expired before W2's began."""
    name = run.name
    h = run.hold_here(name)
    w1 = run.wait("W1")
    wait_queued(obs, name, w1)
    w2 = run.wait("W2")
    wait_queued(obs, name, w2)
    assert queue(obs, name) == [w1, w2]
    run.kill("W1")
    released = run.release_here(h)
    got = run.event(w2, "granted", timeout=15)
    stall = got["t"] - released
    bounds.record("T30", "lease", "next waiter holds after the head waiter was SIGKILLed", stall)
    assert stall <= STALL_BOUND, f"W2 held {stall:.3f} s after the release"
    assert got["token"] > h.token
    out = run.release(w2)
    assert out["ok"], out
    run.assert_one_believer()
    grants = assert_grant_history(obs, run, name)
    assert grants[0].holder == h.holder and grants[-1].holder == w2
    assert {g.holder for g in grants} <= {h.holder, w1, w2}
    assert queue(obs, name) == []


# --- T31 -----------------------------------------------------------------------------------


def test_T31_waiter_whose_network_is_silent_never_believes_a_stale_grant(
    run: Run, obs: psycopg.Connection[Any], bounds: Bounds
) -> None:
    """W1 (head) reaches the server through a proxy that goes silent (nothing forwarded, no
    FIN, no RST) just before the release. W2 holds within 2 s of the release. W1's network
    comes back while W2 still holds: W1 must not believe it holds while W2 does. Precisely, the
    oracle checks that (a) no belief interval of W1 (from ``acquire()`` returning True or
    ``locked`` turning True, to ``locked`` turning False or its release) overlaps W2's, and
    (b) any token W1 ever believes in is larger than W2's: W1 never acts on the grant the
    release may have made to it while it was silent; it may only get a new grant, after W2's
    release."""
    name = run.name
    h = run.hold_here(name)
    with Proxy(run.cluster.port) as proxy:
        w1 = run.wait("W1", port=proxy.port, wait=30)
        wait_queued(obs, name, w1)
        w2 = run.wait("W2")
        wait_queued(obs, name, w2)
        proxy.set_mode("blackhole")
        released = run.release_here(h)
        got = run.event(w2, "granted", timeout=15)
        stall = got["t"] - released
        bounds.record("T31", "lease", "next waiter holds after the head's network went silent",
                      stall)
        assert stall <= STALL_BOUND, f"W2 held {stall:.3f} s after the release"
        time.sleep(1.5)  # past the provisional window of a grant the release may have made W1
        proxy.set_mode("pass")
        time.sleep(2.0)  # W1 talks to the server again while W2 still holds
        out = run.release(w2)
        assert out["ok"], out
        # W1 may now get the lease anew (a larger token), or its wait may have ended.
        with contextlib.suppress(AssertionError):
            run.event(w1, "granted", timeout=10)
        if any(e["holder"] == w1 and e["ev"] == "granted" for e in run.events("W1")):
            run.release(w1)
    w1_tokens = {b[3] for b in run.beliefs() if b[2] == w1}
    assert all(t > got["token"] for t in w1_tokens), (w1_tokens, got["token"])
    run.assert_one_believer()
    assert_grant_history(obs, run, name)


# --- T32 -----------------------------------------------------------------------------------


def test_T32_holder_killed_with_a_queue_goes_to_the_head_then_fifo(
    run: Run, obs: psycopg.Connection[Any], bounds: Bounds
) -> None:
    name = run.name
    ttl = 2.0
    hid = run.wait("H", ttl=ttl, wait=0)
    dead = run.event(hid, "granted")
    waiters = []
    for tag in ("W1", "W2", "W3"):
        waiters.append(run.wait(tag, hold=0.2))
        wait_queued(obs, name, waiters[-1])
    assert queue(obs, name) == waiters
    killed = run.kill("H")
    grants = [run.event(w, "granted", timeout=20) for w in waiters]
    for w in waiters:
        run.event(w, "released", timeout=10)
    bounds.record("T32", "lease", f"queue head took over a SIGKILLed holder (ttl {ttl:g} s)",
                  grants[0]["t"] - killed)
    assert [g["t"] for g in grants] == sorted(g["t"] for g in grants)
    tokens = [dead["token"]] + [g["token"] for g in grants]
    assert tokens == sorted(tokens) and len(set(tokens)) == 4
    history = assert_grant_history(obs, run, name)
    assert [g.holder for g in history] == [hid, *waiters]  # the head, not any waiter
    assert history[1].acquired_at >= history[0].expires_at  # taken over only once expired
    run.assert_one_believer()
    assert queue(obs, name) == []


# --- T33 -----------------------------------------------------------------------------------


def test_T33_handoff_grant_survives_an_immediate_restart(
    run: Run, obs: psycopg.Connection[Any], bounds: Bounds
) -> None:
    """The durability claim: a waiter told of its grant may act on it, so the grant committed
    durably before the NOTIFY. Restart (immediate: a crash and recovery) as soon as the
    waiter reports the grant: the lease row names it, with its token. Negative control: a
    release with nobody to hand to commits without waiting for its flush, by design; the same
    restart right after it forgets it (the released row is back): the restart here does lose
    what was not flushed, so the first check could fail."""
    name = run.name
    h = run.hold_here(name, ttl=60)
    w1 = run.wait("W1", ttl=60)
    wait_queued(obs, name, w1)
    run.release_here(h)
    got = run.event(w1, "granted")
    bounds.record("T33", "lease", "waiter told of its grant -> immediate restart sent",
                  time.monotonic() - got["t"])
    run.cluster.restart("immediate")
    with psycopg.connect(run.cluster.dsn(), autocommit=True) as after:
        assert lease_row(after, name) == (w1, got["token"]), "the handoff's grant was lost"
    run.release(w1)  # its connections died with the server: it reconnects, or lost it
    with psycopg.connect(run.cluster.dsn(), autocommit=True) as after:
        assert_grant_history(after, run, name)

    control = f"{name}:control"
    forgotten = 0
    for _ in range(3):  # a plain (non-durable) release, then the same restart
        lease = pglock.lease(run.dsn("C"), control, ttl=60, holder=run.hid("C"))
        assert lease.acquire(timeout=0)
        lease.release()
        run.cluster.restart("immediate")
        with psycopg.connect(run.cluster.dsn(), autocommit=True) as after:
            if lease_row(after, control) is not None:
                forgotten += 1
                after.execute("DELETE FROM pglock.lease WHERE name = %s", (control,))
    bounds.record("T33", "lease", "negative control: plain releases forgotten by the restart",
                  float(forgotten), "of 3")
    assert forgotten >= 1, "the immediate restart forgot no unflushed commit: it proves nothing"


def test_T33_queue_drains_across_an_immediate_restart(
    run: Run, obs: psycopg.Connection[Any], bounds: Bounds
) -> None:
    """Three waiters queued, the holder hands off to the first, the server crashes and
    recovers at once: the grant made by the handoff is in the history after recovery, tokens
    after the restart are larger than every token before it, and the waiters get the lease one
    at a time. A waiting ``acquire()`` whose connection cannot be made again (the server is
    still down) raises OperationalError, as before the queue: the waiters here do what an
    application does, acquire again with the same handle (``retry``), so they queue again in
    the order they come back, which is recorded, not asserted."""
    name = run.name
    h = run.hold_here(name, ttl=60)
    waiters = []
    for tag in ("W1", "W2", "W3"):
        waiters.append(run.wait(tag, ttl=10, hold=0.3, retry=True))
        wait_queued(obs, name, waiters[-1])
    run.release_here(h)
    first = run.event(waiters[0], "granted")
    run.cluster.restart("immediate")
    restarted = time.monotonic()
    with psycopg.connect(run.cluster.dsn(), autocommit=True) as after:
        before = lease_grants(after, name)
        assert (before[-1].holder, before[-1].token) == (waiters[0], first["token"])
    grants = [run.event(w, "granted", timeout=60) for w in waiters[1:]]
    for w in waiters:
        with contextlib.suppress(AssertionError):
            run.event(w, "released", timeout=20)
    bounds.record("T33", "lease", "queue drained after an immediate restart",
                  grants[-1]["t"] - restarted)
    assert first["token"] < min(g["token"] for g in grants)
    assert len({g["token"] for g in grants}) == 2
    with psycopg.connect(run.cluster.dsn(), autocommit=True) as after:
        history = assert_grant_history(after, run, name)
        firsts = list(dict.fromkeys(g.holder for g in history))
        assert firsts[:2] == [h.holder, waiters[0]]
        assert sorted(firsts[2:]) == sorted(waiters[1:])
        assert queue(after, name) == []
    bounds.record("T33", "lease", "waiters served in arrival order after the restart",
                  float(firsts[2:] == waiters[1:]), "yes=1")
    run.assert_one_believer()


# --- T34 -----------------------------------------------------------------------------------


def test_T34_fifo_50_waiters_over_10_processes(
    run: Run, obs: psycopg.Connection[Any], bounds: Bounds
) -> None:
    """Waiters started one at a time, each confirmed in the queue before the next, round-robin
    over 10 processes: the lease goes to them in that order, one at a time."""
    name = run.name
    h = run.hold_here(name, ttl=60)
    arrival = []
    for i in range(50):
        arrival.append(run.wait(f"P{i % 10}", str(i), ttl=10, hold=0.0))
        wait_queued(obs, name, arrival[-1])
    assert queue(obs, name) == arrival
    released = run.release_here(h)
    grants = [run.event(w, "granted", timeout=60) for w in arrival]
    last = run.event(arrival[-1], "released", timeout=30)
    assert [g["token"] for g in grants] == sorted(g["token"] for g in grants)
    history = assert_grant_history(obs, run, name)
    assert [g.holder for g in history] == [h.holder, *arrival]
    run.assert_one_believer()
    releases = {e["holder"]: e["t"] for e in run.events() if e["ev"] == "release"}
    gaps = [grants[0]["t"] - released] + [
        g["t"] - releases[w] for w, g in zip(arrival, grants[1:], strict=False)
    ]
    bounds.record("T34", "lease", "handoff: release -> next waiter holds (10 processes)",
                  gaps)
    bounds.record("T34", "lease", "50 queued waiters served", last["t"] - released)


# --- T35 -----------------------------------------------------------------------------------

SOAK_PROCS = 5
SOAK_TTL = 1.0
#: How long after its last statement a lease a process no longer renews can stay granted: its
#: TTL, or a waiter's liveness (1 s) and then a handoff grant's provisional window (1 s).
SOAK_BOUND = SOAK_TTL + 2.5


def load_lease_history(paths: list[Path]) -> tuple[dict[str, list[Op]], set[str], set[str], int]:
    """As :func:`.test_soak.load_history`, for leases: a lease is not a session, so a failed
    release or acquire does not end it at once; it ends at some instant by the time its renewals
    stop counting (``SOAK_BOUND`` after the failure). A release refused with LockLost took
    effect (expiry) at some instant since the acquire. An acquire that returned False saying
    why (``why``: no answer, a late grant given back, a wait given up as the lease was handed
    to it; docs/leases.md) may have been granted meanwhile: an unknown outcome too, while a
    plain False (somebody held it) is a definite fail, and :func:`quiet_grants` checks on the
    grant log that pglock granted nothing to such a handle."""
    per_name: dict[str, list[Op]] = defaultdict(list)
    acked: set[str] = set()
    unknown: set[str] = set()
    count = 0
    for path in paths:
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        pending: dict[str, dict[str, Any]] = {}
        held: dict[str, float] = {}  # process -> acquire completion time
        for ev in events:
            if ev["ev"] == "invoke":
                pending[ev["f"]] = ev
                continue
            inv, name, p, t = pending.pop(ev["f"]), ev["name"], ev["p"], ev["t"]
            count += 1
            ops = per_name[name]
            if ev["f"] == "acquire" and (ev["ev"] == "info" or ev.get("why")):
                ops.append(Op(p, "acquire", inv["t"], t + SOAK_BOUND, "info"))
                ops.append(Op(p, "release", inv["t"], t + SOAK_BOUND, "info"))
            elif ev["f"] == "acquire":
                ops.append(Op(p, "acquire", inv["t"], t, ev["ev"]))
                if ev["ev"] == "ok":
                    held[p] = t
                    unknown.add(ev["op"])  # until acknowledged (killed in its section?)
            elif ev["ev"] == "ok":
                held.pop(p, None)
                ops.append(Op(p, "release", inv["t"], t, "ok"))
                if ev["acked"]:
                    acked.add(ev["op"])
                    unknown.discard(ev["op"])
            else:
                since = held.pop(p, inv["t"])
                end = t if ev.get("error") == "LockLost" else t + SOAK_BOUND
                ops.append(Op(p, "release", since, end, "ok"))
                unknown.add(ev["op"])
        _killed(events, pending, held, per_name)
    return per_name, acked, unknown, count


def quiet_grants(paths: list[Path], grants: list[Grant]) -> list[Grant]:
    """Grants (database truth) to a handle whose ``acquire()`` returned a plain False: a grant
    pglock made to a waiter and then gave up without saying so (the model counts that acquire
    as a definite fail)."""
    quiet: set[str] = set()
    for path in paths:
        for line in path.read_text().splitlines():
            ev = json.loads(line) if line.strip() else {}
            if ev.get("f") == "acquire" and ev.get("ev") == "fail" and not ev.get("why"):
                quiet.add(ev["op"])
    return [g for g in grants if g.holder.split("#")[-1] in quiet]


def assert_no_quiet_grants(
    name: str, paths: list[Path], ops: list[Op], grants: list[Grant], tmp: Path
) -> None:
    if quiet := quiet_grants(paths, grants):
        kept = keep_histories(paths, name, ops, grants, tmp)
        pytest.fail(f"{name}: grants to handles whose acquire() returned False: {quiet[:3]}, "
                    f"kept in {kept}")


def keep_histories(
    paths: list[Path], name: str, ops: list[Op], grants: list[Grant], tmp: Path
) -> Path:
    """Copy a failed soak's raw histories, the rejected name's operations and its grant history
    (JSON lines) to ``$PGLOCK_FAULT_ARTIFACTS/T35-<name>`` (default: under the test's tmp_path)."""
    root = Path(os.environ.get("PGLOCK_FAULT_ARTIFACTS") or tmp / "artifacts")
    out = root / f"T35-{name.replace(':', '_')}"
    out.mkdir(parents=True, exist_ok=True)
    logs = [Path(f"{p}.log") for p in paths]  # pglock's messages
    for path in [*paths, *logs, tmp / "nemesis.jsonl"]:
        if path.exists():
            (out / path.name).write_text(path.read_text())
    with (out / "ops.jsonl").open("w") as f:
        for op in ops:
            f.write(json.dumps(op.__dict__) + "\n")
    # Grants are on the database clock (epoch seconds), operations on the monotonic clock.
    offset = time.time() - time.monotonic()
    (out / "clock.json").write_text(json.dumps({"epoch_minus_monotonic": offset}))
    with (out / "grants.jsonl").open("w") as f:
        for g in grants:
            f.write(json.dumps(g.__dict__) + "\n")
    return out


def assert_linearizable(
    name: str, ops: list[Op], paths: list[Path], grants: list[Grant], tmp: Path
) -> None:
    if not check(ops):
        kept = keep_histories(paths, name, ops, grants, tmp)
        pytest.fail(f"history of {name} is not linearizable ({len(ops)} ops), kept in {kept}")


def _killed(
    events: list[dict[str, Any]],
    pending: dict[str, dict[str, Any]],
    held: dict[str, float],
    per_name: dict[str, list[Op]],
) -> None:
    """A killed process: what it was doing has an unknown outcome; what it held ends later."""
    for f, inv in pending.items():
        per_name[inv["name"]].append(Op(inv["p"], f, inv["t"], math.inf, "info"))
        if f == "acquire":
            per_name[inv["name"]].append(Op(inv["p"], "release", inv["t"], math.inf, "info"))
    if "release" not in pending:
        for p, t in held.items():
            name = next(e["name"] for e in reversed(events) if e["p"] == p)
            per_name[name].append(Op(p, "release", t, math.inf, "info"))


@pytest.mark.timeout(300)  # a hang guard: the 20 s soak's WGL check took 90 s on a loaded machine
def test_T35_soak_with_queued_lease_waiters_is_linearizable(
    run: Run, queue_db: Cluster, app_name: str, tmp_path: Path, bounds: Bounds
) -> None:
    """T27 on leases: 5 processes on 3 names, acquire with timeouts 0 / 50 ms / 200 ms / 1 s
    (queued unless 0), a guarded critical section, release; the nemesis terminates backends,
    SIGKILLs and respawns processes, pauses them up to 1 s (past the 1 s TTL sometimes), and
    restarts the server (fast and immediate). ``PGLOCK_LEASE_SOAK_SECONDS`` (default 20)."""
    seconds = float(os.environ.get("PGLOCK_LEASE_SOAK_SECONDS", "20"))
    rng = random.Random(35)
    names = [f"lsoak:{uuid.uuid4()}:{i}" for i in range(3)]
    with psycopg.connect(queue_db.dsn(), autocommit=True) as admin:
        oracles = [Oracle.create(admin) for _ in names]
    histories: list[Path] = []
    deadline = time.monotonic() + seconds
    spawned = itertools.count()

    def spawn() -> Holder:
        tag = f"S{next(spawned)}"
        h = run.proc(tag)
        path = tmp_path / f"soak-{tag}.jsonl"
        histories.append(path)
        h.send(
            "lease_soak", source=run.dsn(tag), dsn=run.dsn(tag), app=f"{app_name}:{tag}",
            names=names, oracles=[o.prefix for o in oracles], ttl=SOAK_TTL,
            timeouts=[0.0, 0.05, 0.2, 1.0], seconds=max(1.0, deadline - time.monotonic()),
            history=str(path), seed=rng.randrange(10**9),
        )
        return h

    procs = [spawn() for _ in range(SOAK_PROCS)]
    actions: dict[str, int] = defaultdict(int)
    restarts = 0
    while time.monotonic() < deadline - 2:
        time.sleep(rng.uniform(0.3, 1.2))
        action = rng.choice(["terminate", "terminate", "kill", "stop", "restart"])
        if action == "restart" and restarts >= 2:
            action = "terminate"
        i = rng.randrange(SOAK_PROCS)
        began, pid = time.monotonic(), procs[i].pid
        if action == "terminate":
            with psycopg.connect(queue_db.dsn(), autocommit=True) as c:
                c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name LIKE %s ORDER BY random() LIMIT 1",
                    (f"{app_name}:S%",),
                )
        elif action == "kill":
            procs[i].kill()
            procs[i] = spawn()
        elif action == "stop":
            procs[i].stop()
            time.sleep(rng.uniform(0.1, 1.0))
            procs[i].cont()
        else:
            queue_db.restart("immediate" if restarts else "fast")
            restarts += 1
        actions[action] += 1
        with (tmp_path / "nemesis.jsonl").open("a") as f:
            f.write(json.dumps({"t": began, "end": time.monotonic(), "action": action,
                                "pid": pid if action in ("kill", "stop") else None}) + "\n")
    for h in procs:
        out = h.reply(timeout=seconds + 60)
        assert out.get("ok"), out

    per_name, acked, unknown, count = load_lease_history(histories)
    grants = 0
    grant_log: dict[str, list[Grant]] = {}
    with psycopg.connect(queue_db.dsn(), autocommit=True) as admin:
        for name, oracle in zip(names, oracles, strict=True):
            verdict = oracle.check(admin, [], closed_only=True)
            assert verdict.overlaps == 0, (name, verdict.summary())
            assert verdict.tokens_increasing, (name, verdict.tokens[:20])
            assert len(set(verdict.ids)) == len(verdict.ids)
            history = grant_log[name] = lease_grants(admin, name)
            assert grant_violations(history, run.app_of) == [], name
            assert_no_quiet_grants(name, histories, per_name[name], history, tmp_path)
            grants += len(history)
        all_ids: set[str] = set()
        for oracle in oracles:
            all_ids |= set(oracle.check(admin, []).ids)
        assert acked <= all_ids, f"lost acknowledged updates: {sorted(acked - all_ids)[:5]}"
        assert all_ids - acked <= unknown
        for oracle in oracles:
            oracle.drop(admin)
    started = time.monotonic()
    for name, ops in per_name.items():
        assert_linearizable(name, ops, histories, grant_log[name], tmp_path)
    bounds.record("T35", "lease", "WGL check of all histories", time.monotonic() - started)
    bounds.record("T35", "lease", "operations in the soak", float(count), "ops")
    bounds.record("T35", "lease", "grants in the audit log", float(grants), "grants")
    bounds.record("T35", "lease", "acknowledged critical sections", float(len(acked)), "sections")
    bounds.record(
        "T35", "lease",
        "nemesis actions (" + ", ".join(f"{k} {v}" for k, v in sorted(actions.items())) + ")",
        float(sum(actions.values())), "actions",
    )
    bounds.record("T35", "lease", "violations (overlaps, grant history, lost updates)", 0.0,
                  "violations")

