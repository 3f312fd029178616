"""Fixtures of the fault suite: throwaway clusters, holder processes, proxies, measured bounds.

* ``cluster``: one throwaway cluster per test module that asks for it, with the settings in the
  module's ``CLUSTER_SETTINGS`` dict (started once per module to save time).
* ``cluster_connect``: connections to that cluster carrying the test's ``app_name``; after the
  test, any advisory lock still held by a session with that name fails it (as ``connect`` does
  for the shared server).
* ``holders``: factory of holder subprocesses, all closed (or killed) after the test.
* ``bounds``: record a measured recovery time; they are printed at the end of the run and,
  when ``PGLOCK_FAULT_BOUNDS`` names a file, appended there as JSON lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from . import netfilter
from .cluster import Cluster, ClusterUnavailable
from .oracles import held_by_app
from .procs import Holder

_BOUNDS: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A throwaway cluster for this module, with the module's ``CLUSTER_SETTINGS``."""
    settings = getattr(request.module, "CLUSTER_SETTINGS", {})
    try:
        c = Cluster(settings)
    except ClusterUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"no throwaway cluster under CI: {exc}", pytrace=False)
        pytest.skip(str(exc))
    try:
        c.start()
        yield c
    finally:
        c.destroy()


@pytest.fixture
def cluster_connect(
    cluster: Cluster, app_name: str
) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    """Factory for connections to the module's cluster (autocommit by default)."""
    opened: list[psycopg.Connection[Any]] = []

    def factory(autocommit: bool = True, **kwargs: Any) -> psycopg.Connection[Any]:
        kwargs.setdefault("application_name", app_name)
        dsn = kwargs.pop("dsn", None) or cluster.dsn()
        c = psycopg.connect(dsn, autocommit=autocommit, **kwargs)
        opened.append(c)
        return c

    yield factory
    leaked: list[Any] = []
    with (
        contextlib.suppress(psycopg.OperationalError),
        psycopg.connect(cluster.dsn(), autocommit=True, application_name="pglock-checker") as obs,
    ):
        leaked = held_by_app(obs, app_name)
    for c in opened:
        with contextlib.suppress(Exception):
            c.close()
    if leaked:
        pytest.fail(f"test leaked advisory locks on the throwaway cluster: {leaked}", pytrace=False)


@pytest.fixture
def observer(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit session on the shared server to look at pg_locks (not the test's app_name)."""
    with psycopg.connect(pg_dsn, autocommit=True, application_name="pglock-fault-observer") as c:
        yield c


@pytest.fixture
def scratch(pg_dsn: str) -> Iterator[sql.Identifier]:
    """A scratch table ``(v text)`` on the shared server, for writes whose fate a test checks."""
    table = sql.Identifier(f"pglock_fault_{uuid.uuid4().hex[:10]}")
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("CREATE TABLE {} (v text)").format(table))
    yield table
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))


@pytest.fixture
def holders() -> Iterator[Callable[..., Holder]]:
    """Factory of holder subprocesses; every one is closed (or killed) after the test.

    ``holders(wait=False)`` returns at once; call ``wait_ready()`` before the first request."""
    made: list[Holder] = []

    def factory(wait: bool = True) -> Holder:
        h = Holder(wait=wait)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()


@pytest.fixture
def kernel_blackhole() -> Iterator[None]:
    """Skip unless iptables blackholes work here; remove any rule the test left behind."""
    reason = netfilter.available()
    if reason:
        pytest.skip(reason)
    try:
        yield
    finally:
        netfilter.heal_all()


class Bounds:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid

    def record(
        self, scenario: str, kind: str, what: str, seconds: float | list[float], unit: str = "s"
    ) -> None:
        values = seconds if isinstance(seconds, list) else [seconds]
        entry = {
            "scenario": scenario,
            "kind": kind,
            "what": what,
            "unit": unit,
            "n": len(values),
            "median": round(statistics.median(values), 4),
            "max": round(max(values), 4),
            "test": self.nodeid,
        }
        _BOUNDS.append(entry)
        path = os.environ.get("PGLOCK_FAULT_BOUNDS")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")


@pytest.fixture
def bounds(request: pytest.FixtureRequest) -> Bounds:
    """Record measured recovery bounds (printed in the terminal summary)."""
    return Bounds(request.node.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _BOUNDS:
        return
    terminalreporter.section("pglock measured fault bounds")
    for b in sorted(_BOUNDS, key=lambda b: (b["scenario"], b["kind"])):
        if b["n"] == 1:
            value = f"{b['median']:.3f} {b['unit']}"
        else:
            value = (
                f"median {b['median']:.3f} {b['unit']}, max {b['max']:.3f} {b['unit']} (n={b['n']})"
            )
        terminalreporter.write_line(f"{b['scenario']} {b['kind']:<16} {b['what']}: {value}")
