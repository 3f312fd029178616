"""The pglock exception tree.

::

    Exception
     └── LockError                       root of everything pglock raises on purpose
          ├── LockNotAcquired            also a TimeoutError: timeout elapsed, or fail-fast lost
          ├── LockLost                   a held lock or lease is gone (expired, taken over,
          │                              session ended, released behind pglock's back)
          ├── DeadlockDetected           Postgres broke a deadlock by failing this waiter (40P01)
          ├── SelfDeadlock               this thread would wait for its own lock (nested through
          │                              a pool): refused before any SQL
          ├── LockTableFull              Postgres's shared lock table is exhausted (53200)
          ├── InvalidConnectionState     the connection cannot take this lock now (closed,
          │                              failed transaction, no transaction for a xact lock)
          ├── UnsupportedServer          a hot standby, or a connection pooler in between
          ├── LimitMismatch              also a ValueError: a semaphore's stored limit differs
          ├── HolderInUse                another live lease handle of this process has the
          │                              same holder id on the same lease
          └── SchemaNotInstalled         the lease schema is missing; the message gives the fix

Bad arguments raise ``ValueError`` and ``TypeError`` before any SQL. Every error carries its
context as attributes and pickles cleanly (docs/reference/errors.md).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any


class LockError(Exception):
    """Root of every error that pglock raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take keyword context; rebuild them from the same keywords.
        return (_rebuild, (type(self), self.args, self.__dict__.copy()))


def _rebuild(cls: type[LockError], args: tuple[Any, ...], state: dict[str, Any]) -> LockError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


def _describe(name: str | None, key: int | None) -> str:
    if name is not None:
        return f"lock {name!r}"
    if key is not None:
        return f"lock key {key}"
    return "lock"


class LockNotAcquired(LockError, TimeoutError):
    """The lock was not acquired: the timeout elapsed, or a fail-fast attempt found it taken.

    :ivar name: the lock name (the first conflicting one for several names), or None.
    :ivar key: the 64-bit key of ``name``, or None.
    :ivar timeout: the timeout in seconds that was allowed (``0`` for fail-fast).
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        key: int | None = None,
        timeout: float | None = None,
        message: str | None = None,
    ) -> None:
        self.name = name
        self.key = key
        self.timeout = timeout
        super().__init__(message or _could_not(_describe(name, key), timeout))

    @classmethod
    def for_names(
        cls,
        names: Sequence[str],
        *,
        keys: Sequence[int] = (),
        timeout: float | None = None,
        what: str = "lock",
        busy: str | None = "it is held by another session",
        detail: str | None = None,
        message: str | None = None,
    ) -> LockNotAcquired:
        """The error for ``names`` (one lock or several taken together) not acquired within
        ``timeout``: ``name`` is the one name or the names joined, ``key`` the one key.

        :param what: the kind of thing, as the message names it (``"lease"``, ``"2 permit(s)
            of semaphore"``).
        :param busy: why a try (``timeout=0``) failed; None says "within 0.00 s".
        :param detail: appended after a colon (who holds it, why it was refused).
        :param message: the whole message instead.
        """
        name = ", ".join(names) if names else None
        key = keys[0] if len(keys) == 1 else None
        text = _could_not(f"{what} {name!r}" if name is not None else what, timeout, busy)
        text = message or (f"{text}: {detail}" if detail else text)
        return cls(name, key=key, timeout=timeout, message=text)


def _could_not(
    what: str, timeout: float | None, busy: str | None = "it is held by another session"
) -> str:
    if timeout is None:
        return f"could not acquire {what}"
    if timeout == 0 and busy is not None:
        return f"could not acquire {what}: {busy}"
    return f"could not acquire {what} within {timeout:.2f} s"


class LockLost(LockError):
    """A lock or lease this process believed it held is no longer held.

    :ivar name: the lock or lease name, or None.
    :ivar reason: a short description of how it was lost.
    """

    def __init__(self, name: str | None = None, *, reason: str = "lost") -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"{_describe(name, None)} was lost: {reason}")

    @classmethod
    def for_names(cls, names: Sequence[str], reason: str) -> LockLost:
        """The error for a lock on ``names`` (taken together) found lost."""
        return cls(", ".join(names), reason=reason)


class DeadlockDetected(LockError):
    """Postgres detected a deadlock and failed this lock request (SQLSTATE 40P01).

    pglock sorts the keys of a multi-name lock, so this only happens when locks are also taken
    in another order (for example by raw SQL, or by nested ``pg_lock`` blocks in different orders).
    """

    def __init__(self, name: str | None = None, *, key: int | None = None) -> None:
        self.name = name
        self.key = key
        super().__init__(f"deadlock detected while acquiring {_describe(name, key)}")


class SelfDeadlock(LockError):
    """This thread asked, without a timeout, for a lock that it already holds through another
    connection of the same pool, and would wait for itself for ever (docs/pools.md). Refused
    before any SQL; a try-once or timed request answers False at once instead.

    :ivar name: the lock name this thread already holds through the pool.
    :ivar key: its 64-bit key.
    """

    def __init__(
        self, name: str | None = None, *, key: int | None = None, message: str | None = None
    ) -> None:
        self.name = name
        self.key = key
        default = (
            f"this thread already holds {_describe(name, key)} through this pool: a nested "
            "lock would check out another connection (another Postgres session) and wait "
            "for itself for ever; reuse the connection yielded by the outer block "
            "(pglock.pg_lock(conn, ...) on it re-enters, counted) instead of nesting "
            "through the pool"
        )
        super().__init__(message or default)


class LockTableFull(LockError):
    """Postgres's shared lock table is full (SQLSTATE 53200, "out of shared memory").

    Release locks, or raise ``max_locks_per_transaction`` on the server.
    """

    def __init__(self, name: str | None = None, *, key: int | None = None) -> None:
        self.name = name
        self.key = key
        super().__init__(
            f"could not acquire {_describe(name, key)}: the server's lock table is full "
            "(out of shared memory); release locks or raise max_locks_per_transaction"
        )


class InvalidConnectionState(LockError):
    """The connection cannot be used for this operation in its current state.

    For example: it is closed or broken, it is in a failed transaction (roll back first), or a
    transaction-level lock was asked for on a connection that has no open transaction.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)

    @classmethod
    def closed(cls) -> InvalidConnectionState:
        return cls("the connection is closed")

    @classmethod
    def failed_transaction(cls) -> InvalidConnectionState:
        return cls("the connection is in a failed transaction; roll it back before taking a lock")

    @classmethod
    def no_transaction(cls, api: str, consequence: str, hint: str = "") -> InvalidConnectionState:
        """``api`` was called in autocommit mode, where what it takes would end at once."""
        return cls(
            f"{api} needs an open transaction: this connection is in autocommit mode, so "
            f"{consequence}; use 'with conn.transaction():'{hint}"
        )

    @classmethod
    def shared_transaction(cls, name: str) -> InvalidConnectionState:
        """Another thread holds (or takes) ``name`` as a transaction lock in this same
        transaction."""
        return cls(
            f"another thread holds {name!r} in this same transaction on this connection (as a "
            "transaction lock, or is taking it now); threads sharing one transaction cannot "
            "exclude each other, so use one connection per thread"
        )


class UnsupportedServer(LockError):
    """The server cannot give the requested guarantee.

    Raised for a hot standby (its advisory locks coordinate nothing with the primary) and for a
    session lock through a connection pooler such as PgBouncer that session locks cannot work
    through: one of unknown mode under ``pooler="auto"``, one declared
    ``pooler="transaction"``, or one seen sharing the server session (session locks would land
    on whichever server connection runs the next transaction; docs/pgbouncer.md).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)


class LimitMismatch(LockError, ValueError):
    """The semaphore exists in the database with another limit than the one passed.

    Change a limit on purpose with
    ``UPDATE <schema>.semaphore SET max_permits = ... WHERE name = ...``.

    :ivar name: the semaphore name.
    :ivar limit: the limit this caller passed.
    :ivar stored_limit: the limit stored in the database (None if it could not be read).
    """

    def __init__(self, name: str, *, limit: int, stored_limit: int | None) -> None:
        self.name = name
        self.limit = limit
        self.stored_limit = stored_limit
        stored = "another limit" if stored_limit is None else f"limit {stored_limit}"
        super().__init__(
            f"semaphore {name!r} is stored with {stored}, but this caller passed limit={limit}; "
            "every user of a semaphore must pass the same limit (to change it on purpose, "
            "update max_permits in the semaphore table of the pglock schema)"
        )


class HolderInUse(LockError):
    """Another lease handle of this process (or of its parent at the fork), with the same holder
    id, is acquiring, holding or releasing the same lease (same database, schema and name).
    Raised before any SQL; see docs/leases.md for why, and for ``resume=True``.

    :ivar name: the lease name.
    :ivar holder: the holder id.
    :ivar schema: the pglock schema.
    """

    def __init__(self, name: str, *, holder: str, schema: str) -> None:
        self.name = name
        self.holder = holder
        self.schema = schema
        super().__init__(
            f"lease {name!r} already has a live handle with holder id {holder!r} in this "
            "process, or had one in its parent at the fork (acquiring, held or releasing): one "
            "holder id has one handle per lease; release that handle first, or use another one"
        )


class SchemaNotInstalled(LockError):
    """The pglock schema (lease table and functions) is not installed in this database.

    :ivar schema: the schema name that was looked for.
    """

    def __init__(self, schema: str, *, message: str | None = None) -> None:
        self.schema = schema
        default = (
            f"the pglock schema {schema!r} is not installed in this database; install it "
            f"with: pglock install --dsn <your DSN> --schema {schema}  "
            "(or run 'alembic upgrade pglock@head' with pglock's migrations)"
        )
        super().__init__(message or default)

    @classmethod
    def for_connection(cls, conn: Any, schema: str) -> SchemaNotInstalled:
        """The error for the database of ``conn`` (a psycopg connection, or None), with the
        exact install command (libpq leaves the password out of the DSN)."""
        try:
            dsn, db = conn.info.dsn, conn.info.dbname
        except Exception:
            dsn, db = "<your DSN>", "?"
        command = f"pglock install --dsn {shlex.quote(dsn)} --schema {schema}"
        return cls(
            schema,
            message=(
                f"the pglock schema {schema!r} is not installed (or is out of date) in database "
                f"{db!r}; install it with: {command}  (or include pglock's migrations in your "
                "Alembic and run 'alembic upgrade pglock@head')"
            ),
        )


__all__ = [
    "DeadlockDetected", "HolderInUse", "InvalidConnectionState", "LimitMismatch", "LockError",
    "LockLost", "LockNotAcquired", "LockTableFull", "SchemaNotInstalled", "SelfDeadlock",
    "UnsupportedServer",
]
