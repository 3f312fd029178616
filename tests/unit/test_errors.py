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
    # The named constructors, which build the messages call sites used to compose.
    (
        LockNotAcquired.for_names(["orders:42"], keys=[K], timeout=5),
        {"name": "orders:42", "key": K, "timeout": 5},
        "could not acquire lock 'orders:42' within 5.00 s",
    ),
    (
        LockNotAcquired.for_names(["a", "b"], keys=[1, 2], timeout=0),
        {"name": "a, b", "key": None, "timeout": 0},
        "could not acquire lock 'a, b': it is held by another session",
    ),
    (
        LockNotAcquired.for_names(["q"], timeout=0, what="lease", busy=None, detail="held by 'w'"),
        {"name": "q", "key": None, "timeout": 0},
        "could not acquire lease 'q' within 0.00 s: held by 'w'",
    ),
    (
        LockNotAcquired.for_names(["a"], keys=[1], timeout=2, message="pool exhausted"),
        {"name": "a", "key": 1, "timeout": 2},
        "pool exhausted",
    ),
    (
        LockLost.for_names(["a", "b"], "the connection was closed"),
        {"name": "a, b", "reason": "the connection was closed"},
        "lock 'a, b' was lost: the connection was closed",
    ),
    (
        SchemaNotInstalled.for_connection(None, "locks"),
        {"schema": "locks"},
        "the pglock schema 'locks' is not installed (or is out of date) in database '?'; "
        "install it with: pglock install --dsn '<your DSN>' --schema locks",
    ),
    (InvalidConnectionState.closed(), {}, "the connection is closed"),
    (
        InvalidConnectionState.failed_transaction(),
        {},
        "the connection is in a failed transaction; roll it back",
    ),
    (
        InvalidConnectionState.no_transaction("xact_lock", "it would end at once", " (or X)"),
        {},
        "xact_lock needs an open transaction: this connection is in autocommit mode, so it "
        "would end at once; use 'with conn.transaction():' (or X)",
    ),
    (
        InvalidConnectionState.shared_transaction("a"),
        {},
        "another thread holds 'a' in this same transaction on this connection",
    ),
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


def test_private_exceptions_are_not_lock_errors() -> None:
    """Internal control flow never subclasses the public tree: a caller's ``except
    pglock.LockError`` must not see it."""
    import importlib
    import pkgutil

    private = []
    for info in pkgutil.iter_modules(pglock.__path__):
        if info.name == "__main__":
            continue
        module = importlib.import_module(f"pglock.{info.name}")
        for attr, obj in vars(module).items():
            if attr.startswith("_") and isinstance(obj, type) and issubclass(obj, BaseException):
                private.append(obj)
    assert private  # the scan finds the control-flow exceptions
    assert [c for c in private if issubclass(c, LockError)] == []


def test_catch_as_timeout_error() -> None:
    with pytest.raises(TimeoutError):
        raise LockNotAcquired("a", timeout=1)
