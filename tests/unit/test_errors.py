"""The exception tree: hierarchy, attributes, messages and pickling (no database)."""

from __future__ import annotations

import pickle

import pytest

import pglock
from pglock.errors import (
    DeadlockDetected,
    InvalidConnectionState,
    LockError,
    LockLost,
    LockNotAcquired,
    LockTableFull,
    SchemaNotInstalled,
    SelfDeadlock,
    UnsupportedServer,
)

K = pglock.key("orders:42")

SAMPLES: list[tuple[LockError, dict[str, object], str]] = [
    (
        LockNotAcquired("orders:42", key=K, timeout=5),
        {"name": "orders:42", "key": K, "timeout": 5},
        "could not acquire lock 'orders:42' within 5.00 s",
    ),
    (
        LockNotAcquired("orders:42", key=K, timeout=0),
        {"name": "orders:42", "key": K, "timeout": 0},
        "could not acquire lock 'orders:42': it is held by another session",
    ),
    (
        LockNotAcquired(None, key=K, timeout=None),
        {"name": None, "key": K, "timeout": None},
        f"could not acquire lock key {K}",
    ),
    (
        LockNotAcquired("a", message="custom text"),
        {"name": "a", "key": None, "timeout": None},
        "custom text",
    ),
    (
        LockLost("job:1", reason="the connection was closed"),
        {"name": "job:1", "reason": "the connection was closed"},
        "lock 'job:1' was lost: the connection was closed",
    ),
    (LockLost(), {"name": None, "reason": "lost"}, "lock was lost: lost"),
    (
        DeadlockDetected("a", key=pglock.key("a")),
        {"name": "a", "key": pglock.key("a")},
        "deadlock detected while acquiring lock 'a'",
    ),
    (
        LockTableFull("a", key=1),
        {"name": "a", "key": 1},
        "could not acquire lock 'a': the server's lock table is full",
    ),
    (InvalidConnectionState("the connection is closed"), {}, "the connection is closed"),
    (UnsupportedServer("this server is a hot standby"), {}, "this server is a hot standby"),
    (
        SchemaNotInstalled("pglock"),
        {"schema": "pglock"},
        "the pglock schema 'pglock' is not installed",
    ),
    (SchemaNotInstalled("s", message="fix it"), {"schema": "s"}, "fix it"),
    (
        SelfDeadlock("job:1", key=pglock.key("job:1")),
        {"name": "job:1", "key": pglock.key("job:1")},
        "this thread already holds lock 'job:1' through this pool",
    ),
]


@pytest.mark.parametrize(
    ("err", "attrs", "text"),
    SAMPLES,
    ids=[f"{type(e).__name__}-{i}" for i, (e, _, _) in enumerate(SAMPLES)],
)
def test_attributes_message_and_pickle(err: LockError, attrs: dict[str, object], text: str) -> None:
    assert isinstance(err, LockError)
    assert str(err).startswith(text)
    for attr, value in attrs.items():
        assert getattr(err, attr) == value
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(err, protocol=protocol))
        assert type(copy) is type(err)
        assert str(copy) == str(err)
        assert copy.args == err.args
        for attr, value in attrs.items():
            assert getattr(copy, attr) == value


def test_pickle_keeps_cause_chain_free_and_module() -> None:
    err = LockNotAcquired("x", key=1, timeout=1.5)
    data = pickle.dumps(err)
    # Pickled by reference to the public module, so it unpickles without private names.
    assert b"pglock" in data
    assert type(pickle.loads(data)).__module__ == "pglock"


def test_hierarchy() -> None:
    assert issubclass(LockNotAcquired, TimeoutError)
    assert issubclass(LockNotAcquired, LockError)
    for cls in (
        LockLost,
        DeadlockDetected,
        LockTableFull,
        InvalidConnectionState,
        UnsupportedServer,
        SchemaNotInstalled,
        SelfDeadlock,
    ):
        assert issubclass(cls, LockError)
        assert not issubclass(cls, TimeoutError)
    assert issubclass(LockError, Exception)


def test_catch_as_timeout_error() -> None:
    with pytest.raises(TimeoutError):
        raise LockNotAcquired("a", timeout=1)
