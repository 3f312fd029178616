"""T27: randomized soak under faults, checked for linearizability (opt-in: ``-m soak``).

5 holder processes loop over 3 names: acquire (timeouts 0 / 50 / 200 ms), a read-modify-write
critical section on the lock's own session (or in its transaction), release; every invoke and
completion goes to a per-process history file. A nemesis meanwhile terminates backends,
SIGKILLs (and respawns) holders, SIGSTOPs them for up to a second, and restarts the throwaway
server. Afterwards:

* every per-name history is linearizable against an owner-aware mutex (Wing-Gong-Lowe);
* no acknowledged update is lost, and anything in the set that was not acknowledged comes
  from a section whose outcome is unknown;
* finished critical sections never overlap;
* the server holds no advisory lock.

``PGLOCK_SOAK_SECONDS`` sets the length (default 40 s per lock kind).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from .cluster import Cluster
from .conftest import Bounds
from .linearizability import Op, check
from .oracles import Oracle
from .procs import Holder

CLUSTER_SETTINGS = {"max_connections": 60}

pytestmark = pytest.mark.soak

PROCS = 5


def load_history(paths: list[Path]) -> tuple[dict[str, list[Op]], set[str], set[str], int]:
    """Ops per name, acknowledged op ids, unknown op ids, operation count."""
    per_name: dict[str, list[Op]] = defaultdict(list)
    acked: set[str] = set()
    unknown: set[str] = set()
    count = 0
    for path in paths:
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        pending: dict[tuple[str, str], dict[str, Any]] = {}
        held: dict[str, tuple[str, float]] = {}  # process -> (name, acquire completion time)
        for ev in events:
            key = (ev["p"], ev["f"])
            if ev["ev"] == "invoke":
                pending[key] = ev
                continue
            inv = pending.pop(key)
            name, p = ev["name"], ev["p"]
            count += 1
            if ev["f"] == "acquire":
                if ev["ev"] == "info":
                    per_name[name].append(Op(p, "acquire", inv["t"], math.inf, "info"))
                    # Its session is gone: if it was granted, it was released at some point.
                    per_name[name].append(Op(p, "release", inv["t"], math.inf, "info"))
                else:
                    per_name[name].append(Op(p, "acquire", inv["t"], ev["t"], ev["ev"]))
                    if ev["ev"] == "ok":
                        held[p] = (name, ev["t"])
            else:
                since = held.pop(p, (name, inv["t"]))[1]
                if ev["ev"] == "ok":
                    per_name[name].append(Op(p, "release", inv["t"], ev["t"], "ok"))
                    (acked if ev["acked"] else unknown).add(ev["op"])
                else:  # lost: released by the server at some time since the acquire
                    per_name[name].append(Op(p, "release", since, ev["t"], "ok"))
                    unknown.add(ev["op"])
        # A process killed mid-operation: whatever it was doing has an unknown outcome, and
        # its session's end released whatever it held.
        for (p, f), inv in pending.items():
            per_name[inv["name"]].append(Op(p, f, inv["t"], math.inf, "info"))
            if f == "acquire":
                per_name[inv["name"]].append(Op(p, "release", inv["t"], math.inf, "info"))
        for p, (name, t) in held.items():
            if (p, "release") not in pending:
                per_name[name].append(Op(p, "release", t, math.inf, "info"))
    return per_name, acked, unknown, count


@pytest.mark.parametrize("kind", ["session", "xact"])
def test_T27_randomized_soak_linearizable(
    kind: str,
    cluster: Cluster,
    holders: Callable[..., Holder],
    app_name: str,
    tmp_path: Path,
    bounds: Bounds,
) -> None:
    seconds = float(os.environ.get("PGLOCK_SOAK_SECONDS", "40"))
    rng = random.Random(27)
    names = [f"soak:{uuid.uuid4()}:{i}" for i in range(3)]
    with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
        oracles = [Oracle.create(admin) for _ in names]
    histories: list[Path] = []
    deadline = time.monotonic() + seconds

    def spawn(i: int) -> Holder:
        h = holders()
        path = tmp_path / f"history-{len(histories)}.jsonl"
        histories.append(path)
        h.send(
            "soak",
            dsn=cluster.dsn(),
            app=app_name,
            kind=kind,
            names=names,
            oracles=[o.prefix for o in oracles],
            seconds=max(1.0, deadline - time.monotonic()),
            history=str(path),
            seed=rng.randrange(10**9),
        )
        return h

    procs = [spawn(i) for i in range(PROCS)]
    actions: dict[str, int] = defaultdict(int)
    restarts = 0
    while time.monotonic() < deadline - 2:
        time.sleep(rng.uniform(0.3, 1.2))
        action = rng.choice(["terminate", "terminate", "kill", "stop", "restart"])
        if action == "restart" and restarts >= 2:
            action = "terminate"
        i = rng.randrange(PROCS)
        if action == "terminate":
            with psycopg.connect(cluster.dsn(), autocommit=True) as c:
                c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = %s ORDER BY random() LIMIT 1",
                    (app_name,),
                )
        elif action == "kill":
            procs[i].kill()
            procs[i] = spawn(i)
        elif action == "stop":
            procs[i].stop()
            time.sleep(rng.uniform(0.1, 1.0))
            procs[i].cont()
        else:
            cluster.restart("fast")
            restarts += 1
        actions[action] += 1
    for h in procs:
        out = h.reply(timeout=seconds + 60)
        assert out.get("ok"), out

    per_name, acked, unknown, count = load_history(histories)
    with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
        assert admin.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        ).fetchone() == (0,)
        for name, oracle in zip(names, oracles, strict=True):
            verdict = oracle.check(admin, [], closed_only=True)
            assert verdict.overlaps == 0, (name, verdict.summary())
            assert len(set(verdict.ids)) == len(verdict.ids)  # no duplicate
        all_ids: set[str] = set()
        for oracle in oracles:
            all_ids |= set(oracle.check(admin, []).ids)
        assert acked <= all_ids, f"lost acknowledged updates: {sorted(acked - all_ids)[:5]}"
        assert all_ids - acked <= unknown
        for oracle in oracles:
            oracle.drop(admin)

    started = time.monotonic()
    for name, ops in per_name.items():
        assert check(ops), f"history of {name} is not linearizable ({len(ops)} ops)"
    bounds.record("T27", kind, "WGL check of all histories", time.monotonic() - started)
    bounds.record("T27", kind, "operations in the soak", float(count), "ops")
    bounds.record("T27", kind, "acknowledged critical sections", float(len(acked)), "sections")
    bounds.record(
        "T27",
        kind,
        "nemesis actions (" + ", ".join(f"{k} {v}" for k, v in sorted(actions.items())) + ")",
        float(sum(actions.values())),
        "actions",
    )


def test_T27_negative_control_without_a_lock_is_not_linearizable(
    cluster: Cluster, holders: Callable[..., Holder], app_name: str, tmp_path: Path
) -> None:
    """The same pipeline (workers, history files, checker) with no lock at all must find
    histories that no mutex could produce, and lost updates."""
    names = [f"soak-none:{uuid.uuid4()}:{i}" for i in range(3)]
    with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
        oracles = [Oracle.create(admin) for _ in names]
    paths = [tmp_path / f"none-{i}.jsonl" for i in range(PROCS)]
    procs = [holders() for _ in range(PROCS)]
    for i, h in enumerate(procs):
        h.send(
            "soak",
            dsn=cluster.dsn(),
            app=app_name,
            kind="none",
            names=names,
            oracles=[o.prefix for o in oracles],
            seconds=3.0,
            history=str(paths[i]),
            seed=i,
        )
    for h in procs:
        assert h.reply(timeout=60).get("ok")
    per_name, acked, _, _ = load_history(paths)
    assert not all(check(ops) for ops in per_name.values())
    with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
        all_ids: set[str] = set()
        for oracle in oracles:
            all_ids |= set(oracle.check(admin, []).ids)
            oracle.drop(admin)
    assert acked - all_ids, "no lost update without a lock: the oracle is blind"
