"""T19: 200 waiters on one lock (the herd), on a throwaway cluster with room for them.

Postgres queues advisory-lock waiters and grants one per release (no thundering herd), so
200 blocked sessions drain one after another with no overlap and no error.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

import pglock

from .cluster import Cluster
from .conftest import Bounds
from .oracles import holders as holders_of
from .oracles import wait_for, waiters

CLUSTER_SETTINGS = {"max_connections": 230}

WAITERS = 200

Connect = Callable[..., psycopg.Connection[Any]]


def test_T19_herd_of_200_waiters_on_one_release(
    cluster: Cluster, cluster_connect: Connect, name: str, bounds: Bounds
) -> None:
    key = pglock.key(name)
    holder, obs = cluster_connect(), cluster_connect()
    first = pglock.pg_lock(holder, name)
    assert first.acquire()
    conns = [cluster_connect() for _ in range(WAITERS)]
    spans: list[tuple[float, float]] = []
    guard = threading.Lock()
    inside = 0
    most = 0
    errors: list[BaseException] = []

    def wait(c: psycopg.Connection[Any]) -> None:
        nonlocal inside, most
        try:
            with pglock.pg_lock(c, name, timeout=60):
                t_in = time.monotonic()
                with guard:
                    inside += 1
                    most = max(most, inside)
                with guard:
                    inside -= 1
                t_out = time.monotonic()
            with guard:
                spans.append((t_in, t_out))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    wait_for(lambda: len(waiters(obs, key)) == WAITERS, timeout=60, what="200 queued waiters")
    released = time.monotonic()
    first.release()
    for t in threads:
        t.join(60)
    drained = time.monotonic() - released
    assert not errors, errors[:3]
    assert len(spans) == WAITERS
    assert most == 1
    assert holders_of(obs, key) == []
    spans.sort()
    handoffs = [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    assert min(handoffs) >= 0  # each waiter entered after the previous one left
    bounds.record("T19", "session", "200 waiters drained after one release (total)", drained)
    bounds.record("T19", "session", "handoff release -> next holder", handoffs)
