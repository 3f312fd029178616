"""pglock: distributed locks on Postgres alone. The README says which lock fits which job."""

from __future__ import annotations

from . import _fork  # noqa: F401 (a forked child's fresh start)
from ._advisory import PgLock, pg_lock
from ._inspect import AdvisoryLock, SemaphoreHolder, SemaphoreInfo, advisory_locks, semaphores
from ._keys import MAX_NAME_BYTES, key
from ._leader import LeaderElection, leader
from ._lease import Lease, LeaseInfo, lease, lease_info, list_leases
from ._locker import Locker
from ._pool import PoolLock, pool_lock, reset_connection
from ._rwlock import RWLock, rwlock
from ._schema import install
from ._semaphore import Permit, Semaphore, semaphore
from ._singleton import Singleton, singleton
from ._telemetry import configure_telemetry
from ._xact import try_xact_lock, xact_lock
from .errors import (
    DeadlockDetected,
    HolderInUse,
    InvalidConnectionState,
    LimitMismatch,
    LockError,
    LockLost,
    LockNotAcquired,
    LockTableFull,
    SchemaNotInstalled,
    SelfDeadlock,
    UnsupportedServer,
)

__version__ = "0.1.0"

__all__ = [
    "MAX_NAME_BYTES",
    "AdvisoryLock",
    "DeadlockDetected",
    "HolderInUse",
    "InvalidConnectionState",
    "LeaderElection",
    "Lease",
    "LeaseInfo",
    "LimitMismatch",
    "LockError",
    "LockLost",
    "LockNotAcquired",
    "LockTableFull",
    "Locker",
    "Permit",
    "PgLock",
    "PoolLock",
    "RWLock",
    "SchemaNotInstalled",
    "SelfDeadlock",
    "Semaphore",
    "SemaphoreHolder",
    "SemaphoreInfo",
    "Singleton",
    "UnsupportedServer",
    "__version__",
    "advisory_locks",
    "configure_telemetry",
    "install",
    "key",
    "leader",
    "lease",
    "lease_info",
    "list_leases",
    "pg_lock",
    "pool_lock",
    "reset_connection",
    "rwlock",
    "semaphore",
    "semaphores",
    "singleton",
    "try_xact_lock",
    "xact_lock",
]

# Public classes report the package as their home (repr, docs, pickling by reference).
for _name in __all__:
    if isinstance(globals()[_name], type):
        globals()[_name].__module__ = "pglock"
del _name
