"""Values that leases and semaphores store are validated alike, before any SQL (TTLs, metadata):
a DSN source does no I/O at construction, so nothing here needs a server."""

from __future__ import annotations

import pytest

import pglock


@pytest.mark.parametrize(
    ("metadata", "error"),
    [
        ({"k": "a\x00b"}, ValueError),  # jsonb refuses NUL
        ({"k": "\ud800"}, ValueError),  # and lone surrogates
        ({"k": "x" * 300_000}, ValueError),  # over MAX_METADATA_BYTES
        ({"k": float("nan")}, ValueError),  # not JSON
        ({"k": object()}, TypeError),  # not JSON-serializable
    ],
)
def test_semaphore_metadata_is_validated_as_lease_metadata(
    metadata: object, error: type[Exception]
) -> None:
    """A DSN source does no I/O at construction: these fail before any connection or SQL."""
    with pytest.raises(error, match="metadata"):
        pglock.semaphore("postgresql://nobody@127.0.0.1:1/none", "n", limit=1, metadata=metadata)
    with pytest.raises(error, match="metadata"):
        pglock.lease("postgresql://nobody@127.0.0.1:1/none", "n", metadata=metadata)


@pytest.mark.parametrize("ttl", [10**400, float("inf"), 86400.5], ids=["10**400", "inf", "86400.5"])
def test_semaphore_ttl_is_validated_as_a_lease_ttl(ttl: float) -> None:
    with pytest.raises(ValueError, match="at most 86400 seconds"):
        pglock.semaphore("postgresql://nobody@127.0.0.1:1/none", "n", limit=1, ttl=ttl)
    with pytest.raises(ValueError, match="at most 86400 seconds"):
        pglock.lease("postgresql://nobody@127.0.0.1:1/none", "n", ttl=ttl)


def test_one_default_sentinel_with_a_readable_repr() -> None:
    """Every lock kind's ``timeout`` default is the same object, and ``help()`` reads it."""
    import inspect

    defaults = {
        inspect.signature(f).parameters["timeout"].default
        for f in (
            pglock.PgLock.acquire,
            pglock.Lease.acquire,
            pglock.RWLock.read,
            pglock.RWLock.write,
            pglock.PoolLock.acquire,  # Locker.lock forwards PoolLockOptions (timeout)
        )
    }
    assert len(defaults) == 1
    assert repr(defaults.pop()) == "<the lock's timeout>"
