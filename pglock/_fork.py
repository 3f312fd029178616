"""What a forked child starts with (docs/locks.md, "Processes and fork"): none of its parent's
threads, locks, queues or registries, none of its connections (abandoned, never closed: a close
would end the parent's sessions), nothing it holds (each hold records the pid that took it)."""

from __future__ import annotations

import os
import threading

from . import _claims, _conn, _deadline, _keepalive, _pool, _registry, _source, _waiting


def _after_fork_in_child() -> None:
    _claims.parents.update(key for key, ref in _claims._claims.items() if ref() is not None)
    _claims._claims.clear()
    _claims.lock, _conn._registry_lock = threading.Lock(), threading.Lock()
    _registry._lock, _source._dsn_lock = threading.Lock(), threading.Lock()
    _deadline._watchdog = _deadline._Watchdog()
    _keepalive.fresh()
    _waiting.waiters = _waiting._Waiters()
    _pool._pooled = _pool._Marks()
    _source._dsn_sources.clear()
    for source in _source._every:
        source._idle, source._lock = [], threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
