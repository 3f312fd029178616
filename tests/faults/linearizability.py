"""A small Wing-Gong-Lowe linearizability checker for lock histories (T27).

A history is a list of :class:`Op`: who (a session), what (``acquire`` / ``release``), when it
was invoked and when it completed, and how it ended:

``ok``
    it took effect, at one instant between invoke and complete;
``fail``
    an acquire that did not get the lock: legal only if someone held it at one instant
    between invoke and complete (a timeout or a fail-fast that found it taken);
``info``
    the outcome is unknown (the process died, the connection broke): it may have taken effect
    at any instant after invoke, or never.

Model: an owner-aware mutex (Knossos ``mutex`` with owners, as in Jepsen's Hazelcast suite):
only a free lock can be acquired, only its owner releases it. The search is Wing & Gong's
with Lowe's memoisation of (linearized set, model state); histories are checked per lock name
(P-compositionality), as Jepsen does with independent keys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    process: str
    f: str  # "acquire" or "release"
    invoke: float
    complete: float  # math.inf for info
    type: str  # "ok", "fail", "info"


Free = None


def _step(state: str | None, op: Op) -> tuple[bool, str | None]:
    """Apply ``op`` to the mutex state (its owner, or None). Returns (legal, new state)."""
    if op.f == "acquire":
        if op.type == "fail":
            return state is not None, state
        return state is None, op.process
    if op.f == "release":
        return state == op.process, None
    raise ValueError(f"unknown operation {op.f!r}")


def check(history: Sequence[Op], *, initial: str | None = Free) -> bool:
    """True if ``history`` is linearizable against the owner-aware mutex."""
    ops = sorted(history, key=lambda o: o.invoke)
    must = 0  # ok and fail ops must be linearized; info ops may be dropped
    for i, o in enumerate(ops):
        if o.type != "info":
            must |= 1 << i
    seen: set[tuple[int, str | None]] = set()
    # Depth-first search with an explicit stack (histories have thousands of operations).
    stack: list[list[tuple[int, str | None]]] = [[(0, initial)]]
    while stack:
        frame = stack[-1]
        if not frame:
            stack.pop()
            continue
        done, state = frame.pop()
        if done & must == must:
            return True
        if (done, state) in seen:
            continue
        seen.add((done, state))
        stack.append(_moves(ops, done, state))
    return False


def _moves(ops: Sequence[Op], done: int, state: str | None) -> list[tuple[int, str | None]]:
    """The states reachable by linearizing one more operation (last = tried first)."""
    first = ((done + 1) & ~done).bit_length() - 1  # the lowest operation not yet linearized
    # The next op must have been invoked before the earliest completion among pending ops;
    # ops are sorted by invoke and complete >= invoke, so the scan can stop at the horizon.
    horizon = math.inf
    candidates: list[int] = []
    for i in range(first, len(ops)):
        o = ops[i]
        if o.invoke > horizon:
            break
        if done >> i & 1:
            continue
        candidates.append(i)
        horizon = min(horizon, o.complete)
    out: list[tuple[int, str | None]] = []
    for i in candidates:
        o = ops[i]
        if o.invoke > horizon:
            continue
        if o.type == "info":
            out.append((done | 1 << i, state))  # an unknown outcome that never took effect
        legal, new = _step(state, o)
        if legal:
            out.append((done | 1 << i, new))
    return out
