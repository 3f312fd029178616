"""Lock names: validation and the name -> 64-bit key contract.

The contract (stable across versions, processes and platforms)::

    key(name) = int.from_bytes(sha256(name.encode("utf-8")).digest()[:8], "big", signed=True)

Names are compared exactly: no case folding, no Unicode normalisation ("é" and "e\u0301" are
different locks). A name is a non-empty ``str`` of at most :data:`MAX_NAME_BYTES` bytes in UTF-8,
without NUL characters or lone surrogates.

``Locker(source, namespace=ns)`` locks (and hashes) the full name ``f"{ns}:{name}"``:
``Locker(pool, namespace="billing").lock("x")`` is ``pg_lock(conn, "billing:x")``. A namespace
follows the rules for names and has no ``":"`` (so two namespaces never make the same full
name); the full name must fit :data:`MAX_NAME_BYTES`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from typing import Any, TypeVar, cast

#: The longest name accepted, in UTF-8 bytes. Lease names are a primary key and Postgres btree
#: index rows are limited to about 2704 bytes, so the cap stays well below that.
MAX_NAME_BYTES = 1024

#: The longest wait pglock can hand to ``lock_timeout`` (Postgres takes INT_MAX milliseconds).
MAX_TIMEOUT = 2_147_483.0

_T = TypeVar("_T")
#: Each builtin type's own copy of a subclass's value (``str(x)``, ``float(x)``... are the
#: subclass's to override): a str Enum member becomes its value, an IntEnum member an int.
_BY_VALUE: Any = ((bool, bool), (str, str.__str__), (int, int.__index__), (float, float.__float__))


def exact(value: _T) -> _T:
    """``value`` as its exact builtin type, by value: the one coercion of every argument, so
    that a ``str``/``int``/``float`` subclass or Enum member is the same lock, lease, key and
    message as its plain value. Other objects are returned as they are."""
    for kind, copy in _BY_VALUE:
        if isinstance(value, kind):
            return cast(_T, copy(value))
    return value


def validate_name(name: object) -> str:
    """Return ``name`` if it is a valid lock name, else raise ``TypeError``/``ValueError``."""
    if not isinstance(name, str):
        raise TypeError(f"a lock name must be a str, not {type(name).__name__}")
    name = exact(name)
    if not name:
        raise ValueError("a lock name must not be empty")
    if "\x00" in name:
        raise ValueError("a lock name must not contain NUL (\\x00) characters")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            "a lock name must be valid Unicode text (it contains a lone surrogate)"
        ) from None
    if len(encoded) > MAX_NAME_BYTES:
        raise ValueError(
            f"a lock name must be at most {MAX_NAME_BYTES} bytes in UTF-8, got {len(encoded)}"
        )
    return name


def key(name: str) -> int:
    """Return the signed 64-bit advisory-lock key of ``name``.

    The first 8 bytes of the SHA-256 digest of the UTF-8 name, read big-endian and signed.
    The same name gives the same key in every process, on every platform, in every version.

    :raises TypeError: ``name`` is not a ``str``.
    :raises ValueError: ``name`` is empty, too long, or contains NUL or lone surrogates.

    >>> key("account:1") == key("account:1")
    True
    """
    return _key(validate_name(name))


@functools.lru_cache(maxsize=4096)
def _key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big", signed=True)


@functools.lru_cache(maxsize=4096)
def _pair(name: str) -> tuple[int, str]:
    """``(key, name)`` of a valid name (an invalid one raises, and is not cached)."""
    return _key(validate_name(name)), name


def normalize_names(names: object) -> list[tuple[int, str]]:
    """Validate one name or several; return ``(key, name)`` pairs sorted by key, one per key
    (every process takes several names in the same order, so overlapping sets cannot deadlock).
    """
    if isinstance(names, str):
        return [_pair(exact(names))]
    if isinstance(names, (bytes, bytearray, memoryview)):
        raise TypeError("a lock name must be a str, not bytes; decode it first")
    if not isinstance(names, (list, tuple, set, frozenset)):
        raise TypeError(
            f"names must be a str or a list/tuple/set of str, not {type(names).__name__}"
        )
    if not names:
        raise ValueError("at least one lock name is required")
    by_key: dict[int, str] = {}
    for n in map(validate_name, names):
        by_key.setdefault(_key(n), n)
    return sorted(by_key.items())


class _LockDefault:
    """The default of ``acquire(timeout=...)`` and the like, for every lock kind: the timeout the
    lock was made with (a repr that reads well in ``help()``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<the lock's timeout>"


#: See :class:`_LockDefault`; compare with ``is``.
DEFAULT: Any = _LockDefault()


def validate_timeout(timeout: object, *, what: str = "timeout") -> float | None:
    """Check a wait timeout: ``None`` (wait forever), ``0`` (try once) or a positive number."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{what} must be None or a number of seconds, not {type(timeout).__name__}")
    value = float(timeout := exact(timeout))
    if math.isnan(value):
        raise ValueError(f"{what} must be a number of seconds, not NaN")
    if value < 0:
        raise ValueError(f"{what} must be >= 0 seconds (None waits forever), got {timeout!r}")
    if math.isinf(value) or value > MAX_TIMEOUT:
        raise ValueError(
            f"{what} must be at most {MAX_TIMEOUT:.0f} seconds; use None to wait forever"
        )
    return value


def validate_flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {type(value).__name__}")
    return value


def deadline(timeout: float | None) -> float | None:
    """The monotonic instant a wait of ``timeout`` seconds ends (None: never)."""
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (never negative; None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
