"""What a forked child starts with (docs/locks.md, "Processes and fork"): no lock held (a parent
thread may have held any), none of its parent's threads, queues, registries, holder ids or
connections (abandoned, never closed: a close would end the parent's sessions), nothing it holds."""

from __future__ import annotations

import os
import sys
import threading

from . import _claims, _deadline, _keepalive, _pool, _source, _tracked, _waiting

_SYNC = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Event)


def _after_fork_in_child() -> None:
    modules = [m for name, m in list(sys.modules.items()) if name.partition(".")[0] == "pglock"]
    for obj in [*modules, *_tracked.objects]:
        for value in list(vars(obj).values()):
            if type(value) in _SYNC:  # in place (shared ones too), as threading does its own
                value._at_fork_reinit()
        if isinstance(obj, _tracked.Tracked):
            obj._forget_threads()
        if isinstance(obj, _source.DsnSource):
            obj._idle = []
    _claims.parents.update(key for key, ref in _claims._claims.items() if ref() is not None)
    _claims._claims.clear()
    _deadline._watchdog = _deadline._Watchdog()
    _keepalive.fresh()
    _waiting.waiters = _waiting._Waiters()
    _pool._pooled = _pool._Marks()
    _source._dsn_sources.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
