"""Holder ids: the default one (unique per handle), and the rule of one live handle per holder
id and lease in a process and its forked children (see :class:`pglock.Lease`)."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any, Protocol

_holder_prefix: tuple[int, str] | None = None
_holder_count = itertools.count(1)


def default_holder() -> str:
    """A holder id unique to one handle: ``<host>:<pid>:<random hex>-<n>`` (the random part is
    drawn once per process, the counter makes each handle's id its own)."""
    global _holder_prefix
    pid = os.getpid()
    if _holder_prefix is None or _holder_prefix[0] != pid:
        _holder_prefix = (pid, f"{socket.gethostname()[:64]}:{pid}:{uuid.uuid4().hex[:16]}")
    return f"{_holder_prefix[1]}-{next(_holder_count)}"


class Claimant(Protocol):
    """What the registry asks of a handle (a :class:`pglock.Lease`)."""

    _claim_key: tuple[Any, ...]  # (database, schema, name, holder id)
    _lock: threading.Lock
    _superseded: bool  # another handle took the claim over: a release of this one sends nothing

    def _claim_state(self) -> tuple[bool, bool]:
        """With its ``_lock`` held: (live: acquiring, holding or releasing, not lost; holding)."""
        ...

    def _lose(self, reason: str) -> None: ...


#: The handle of each claim key that is acquiring, holding or releasing it in this process.
_claims: dict[tuple[Any, ...], weakref.ref[Any]] = {}
#: Guards the claims (and, taken first, a release's change of state: see Lease.release).
lock = threading.Lock()
#: Prune the claims of collected handles (lost leases never released) past this many.
_prune_at = 1024
parents: set[tuple[Any, ...]] = set()  # in a forked child: its parents' live claims at the fork


def claim(handle: Claimant, *, resume: bool, in_use: Callable[[], Exception]) -> None:
    """Make ``handle`` the one of its claim key, before any SQL, or raise ``in_use()``. A lost
    handle is superseded (its release sends nothing); so is a live one that ``handle`` resumes."""
    superseded: Claimant | None = None
    with lock:
        if handle._claim_key in parents:
            raise in_use()
        other_ref = _claims.get(handle._claim_key)
        other: Claimant | None = None if other_ref is None else other_ref()
        if other is not None and other is not handle:
            with other._lock:
                live, holding = other._claim_state()
                if live and not (resume and holding):
                    raise in_use()
                other._superseded = True
            superseded = other if live else None
        _claims[handle._claim_key] = weakref.ref(handle)
        _prune()
        with handle._lock:
            handle._superseded = False
    if superseded is not None:
        superseded._lose("another handle of this process resumed it with the same holder id")


def unclaim(handle: Claimant) -> None:
    with lock:
        ref = _claims.get(handle._claim_key)
        if ref is not None and ref() is handle:
            del _claims[handle._claim_key]


def _prune() -> None:
    """With ``lock`` held: forget the claims of handles that were collected."""
    global _prune_at
    if len(_claims) <= _prune_at:
        return
    for key in [k for k, ref in _claims.items() if ref() is None]:
        del _claims[key]
    _prune_at = max(1024, 2 * len(_claims))

