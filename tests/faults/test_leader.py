"""T22: leader election under kill and pause (shared server, candidates in subprocesses).

Each candidate logs, with monotonic times, every change of its ``is_leader`` belief (polled
every 5 ms) and its callbacks. Beliefs of different candidates must never overlap, terms must
rise with every new leader, and a killed leader must be replaced; a paused one keeps its
session (TCP is alive), so nobody else takes over while it sleeps.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import pglock

from .conftest import Bounds
from .oracles import wait_for
from .procs import Holder

if not hasattr(pglock, "leader"):
    pytest.skip("pglock.leader is not there yet", allow_module_level=True)


def events(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def belief_intervals(path: Path, end: float) -> list[tuple[float, float, object]]:
    """[believes, doubts) intervals; one still open ends at ``end`` (kill time or now)."""
    out = []
    start: float | None = None
    term: object = None
    for ev in events(path):
        if ev["ev"] == "believes":
            start, term = float(ev["t"]), ev["term"]  # type: ignore[arg-type]
        elif ev["ev"] == "doubts" and start is not None:
            out.append((start, float(ev["t"]), term))  # type: ignore[arg-type]
            start = None
    if start is not None:
        out.append((start, end, term))
    return out


def leader_of(paths: list[Path]) -> int | None:
    for i, p in enumerate(paths):
        iv = belief_intervals(p, time.monotonic())
        if iv and iv[-1][1] >= time.monotonic() - 0.05 and _open(p):
            return i
    return None


def _open(path: Path) -> bool:
    evs = [e for e in events(path) if e["ev"] in ("believes", "doubts")]
    return bool(evs) and evs[-1]["ev"] == "believes"


def test_T22_leader_killed_and_paused(
    pg_dsn: str,
    app_name: str,
    name: str,
    holders: Callable[..., Holder],
    tmp_path: Path,
    bounds: Bounds,
) -> None:
    dsn = pg_dsn + ("&" if "?" in pg_dsn else "?") + f"application_name={app_name}"
    paths = [tmp_path / f"cand-{i}.jsonl" for i in range(3)]
    procs = [holders() for _ in range(3)]
    for h, p in zip(procs, paths, strict=True):
        h.request("candidate", dsn=dsn, name=name, history=str(p), check_interval=0.2)
    ends: dict[int, float] = {}

    wait_for(lambda: leader_of(paths) is not None, timeout=20, what="a first leader")
    first = leader_of(paths)
    assert first is not None

    # Pause the leader: its session stays up, so nobody may take over while it sleeps.
    procs[first].stop()
    time.sleep(2.0)
    others = [i for i in range(3) if i != first]
    assert not any(_open(paths[i]) for i in others)
    procs[first].cont()

    # Kill it: another candidate becomes leader.
    killed = procs[first].kill()
    ends[first] = killed
    wait_for(lambda: any(_open(paths[i]) for i in others), timeout=30, what="a new leader")
    second = next(i for i in others if _open(paths[i]))
    elected = next(float(e["t"]) for e in events(paths[second]) if e["ev"] == "believes")
    bounds.record(
        "T22", "leader", "new leader acts after the leader was SIGKILLed", elected - killed
    )

    # Beliefs never overlap; terms rise with each new leader.
    now = time.monotonic()
    intervals = sorted(
        iv for i, p in enumerate(paths) for iv in belief_intervals(p, ends.get(i, now))
    )
    for a, b in itertools.pairwise(intervals):
        same_term = a[2] == b[2]
        assert same_term or a[1] <= b[0], f"two leaders believed at once: {a} {b}"
    terms = [iv[2] for iv in intervals]
    distinct = [t for k, t in enumerate(terms) if k == 0 or t != terms[k - 1]]
    assert all(x < y for x, y in itertools.pairwise(distinct)), terms
