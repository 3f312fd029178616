"""Which threads hold which keys on one connection (docs/how-it-works.md, "Threads sharing a
connection"). Bookkeeping only; the SQL is sent by :mod:`pglock._advisory` and :mod:`pglock._xact`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from ._conn import IDLE, ConnState, KeyHold, XactHold
from ._keys import remaining
from .errors import InvalidConnectionState, LockError

#: The longest a thread waits in the process without looking for collected holds (seconds).
_COLLECTED_POLL = 1.0

#: The outcome of a transaction-lock statement ended by an unexpected error or an interrupt.
UNKNOWN: Any = object()


class Recheck(Exception):
    """Another thread's settled transaction-lock records conflict: check them in pg_locks."""

    def __init__(self, records: dict[int, XactHold]) -> None:
        super().__init__("recheck")
        self.records = records


def _blocked(
    state: ConnState, keys: Sequence[int], names: Sequence[str], me: threading.Thread, mode: str
) -> bool:
    """Under ``state.cond``: must ``me`` wait before taking ``keys`` as a session lock?"""
    for k, n in zip(keys, names, strict=True):
        hold = state.holds.get(k)
        if hold is None:
            continue
        if me in hold.owners:
            if hold.mode == "s" and mode == "x":
                raise LockError(
                    f"this thread holds {n!r} shared and asks for it exclusive: "
                    "upgrading a lock is not supported; release it first"
                )
            continue  # re-entry, counted
        if hold.pending or hold.mode == "x" or mode == "x":
            return True
    return False


def reserve(
    conn: psycopg.Connection[Any], state: ConnState, keys: Sequence[int], names: Sequence[str],
    *, shared: bool, deadline: float | None, stop: Callable[[], bool], checked: bool = False,
) -> list[int] | None:
    """Wait until no other thread holds ``keys`` on this session in a conflicting mode, then
    record this thread as a holder of all of them. Returns the keys the session must still take
    from Postgres, or None at the deadline or once ``stop()``."""
    me = threading.current_thread()
    mode = "s" if shared else "x"
    with state.lock:
        _drop_collected(state)
        if not state.holds and not state.xact:  # the common case: nothing else on the session
            for k in keys:
                state.holds[k] = KeyHold(mode, {me: 1}, pending=True)
            return list(keys)
        while True:
            if state.xact:
                xact_conflicts(conn, state, keys, names, checked)
            if not _blocked(state, keys, names, me, mode):
                break
            left = remaining(deadline)
            if left == 0.0 or stop():
                return None
            _sleep(state, left)
        need: list[int] = []
        for k in keys:
            hold = state.holds.get(k)
            if hold is None:
                state.holds[k] = KeyHold(mode, {me: 1}, pending=True)
                need.append(k)
            else:
                hold.owners[me] = hold.owners.get(me, 0) + 1
        return need


def unreserve(state: ConnState, keys: Sequence[int], me: threading.Thread) -> list[int]:
    """Drop one count of ``me`` from ``keys``; return the keys no thread holds any more (pending
    until :func:`settle`, so other threads wait)."""
    with state.lock:
        return _unreserve(state, keys, me)


def _unreserve(state: ConnState, keys: Sequence[int], me: threading.Thread) -> list[int]:
    emptied: list[int] = []
    for k in keys:
        hold = state.holds.get(k)
        if hold is None:
            continue
        left = hold.owners.get(me, 0) - 1
        if left > 0:
            hold.owners[me] = left
        else:
            hold.owners.pop(me, None)
        if not hold.owners:
            hold.pending = True
            emptied.append(k)
    return emptied


def _drop_collected(state: ConnState) -> None:
    """Under ``state.lock``: drop the holds of handles collected unreleased; their unlocks go
    with pglock's next statement on the connection (ConnState.deferred)."""
    while state.collected:
        keys, owner = state.collected.pop()
        emptied = _unreserve(state, keys, owner)
        state.deferred.extend((k, state.holds[k].mode == "s") for k in emptied)
        for k in emptied:
            state.holds.pop(k, None)
    if state.sleepers:
        state.cond.notify_all()


def _sleep(state: ConnState, left: float | None) -> None:
    """Under ``state.lock``: wait for a change, a second at most: a handle collected meanwhile
    (PgLock.__del__, which may not wait for this lock) frees what it held."""
    state.sleepers += 1
    try:
        state.cond.wait(_COLLECTED_POLL if left is None else min(left, _COLLECTED_POLL))
    finally:
        state.sleepers -= 1
    _drop_collected(state)


def settle(state: ConnState, granted: Sequence[int], dropped: Sequence[int]) -> None:
    with state.lock:
        for k in granted:
            hold = state.holds.get(k)
            if hold is not None:
                hold.pending = False
        for k in dropped:
            state.holds.pop(k, None)
        if state.sleepers:
            state.cond.notify_all()


def xact_conflicts(
    conn: psycopg.Connection[Any], state: ConnState, keys: Sequence[int], names: Sequence[str],
    checked: bool,
) -> None:
    """Under ``state.cond``: refuse, or ask for a pg_locks check (:class:`Recheck`), when
    another thread has a transaction-lock record on one of ``keys``. On an idle connection
    settled records are of ended transactions: dropped. A pending one refuses at once, as does
    any once pg_locks was checked (``checked``: it was made since, in this transaction)."""
    me = threading.current_thread()
    foreign = {k: r for k in keys if (r := state.xact.get(k)) is not None and r.owner is not me}
    if foreign and conn.pgconn.transaction_status == IDLE:
        for k, r in list(foreign.items()):
            if not r.pending:
                del state.xact[k]
                del foreign[k]
    if not foreign:
        return
    if checked or any(r.pending for r in foreign.values()):
        first = list(keys).index(next(iter(foreign)))
        raise InvalidConnectionState.shared_transaction(names[first])
    raise Recheck(foreign)


def xact_reserve(
    conn: psycopg.Connection[Any], state: ConnState, keys: Sequence[int], names: Sequence[str],
    *, shared: bool, deadline: float | None, checked: bool = False,
) -> dict[int, XactHold | None] | None:
    """Record this thread as taking ``keys`` in the connection's transaction, before any SQL,
    after waiting while another thread holds one as a conflicting session lock here. Returns
    the records it replaced (restored if the attempt fails), or None at the deadline.

    :raises InvalidConnectionState: another thread holds or is taking a key in this transaction.
    :raises Recheck: another thread's record conflicts and pg_locks must say if it is stale.
    """
    me = threading.current_thread()
    mode = "s" if shared else "x"
    with state.lock:
        _drop_collected(state)
        while state.holds and _session_conflict(state, keys, me, mode):
            left = remaining(deadline)
            if left == 0.0:
                return None
            _sleep(state, left)
        if state.xact:
            xact_conflicts(conn, state, keys, names, checked)
        prior = {k: state.xact.get(k) for k in keys}
        for k in keys:
            state.xact[k] = XactHold(me, mode)
        return prior


def _session_conflict(
    state: ConnState, keys: Sequence[int], me: threading.Thread, mode: str
) -> bool:
    """Under ``state.cond``: does another thread hold (or take, or give back) one of ``keys``
    as a session lock on this connection, in a mode that excludes ``mode``?"""
    for k in keys:
        hold = state.holds.get(k)
        if hold is None:
            continue
        if not hold.owners:
            return True  # being released: the session holds it until the unlock has run
        others = any(o is not me for o in hold.owners)
        if others and (hold.mode == "x" or mode == "x"):
            return True
    return False


def xact_settle(
    state: ConnState, keys: Sequence[int], prior: dict[int, XactHold | None], started: Any
) -> None:
    """Turn this attempt's reservations into records (granted), back into what they replaced
    (``started`` is None), or into records of unknown outcome (:data:`UNKNOWN`)."""
    me = threading.current_thread()
    with state.lock:
        mine = {k: r for k in keys if (r := state.xact.get(k)) is not None and r.owner is me}
        if started is None:
            for k in mine:
                before = prior.get(k)
                if before is None:
                    del state.xact[k]
                else:
                    state.xact[k] = before
            return
        if started is not UNKNOWN and len(state.xact) > len(mine):
            # Records of other, ended transactions (the connection has one at a time).
            for k, r in list(state.xact.items()):
                if not r.pending and r.started is not None and r.started != started:
                    del state.xact[k]
        for r in mine.values():
            r.pending = False
            r.started = None if started is UNKNOWN else started
