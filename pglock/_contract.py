"""The database contract: what pglock's Python code and its installed SQL must agree on.

A leaf module (it imports nothing from pglock), so revisions and runtime code share it.
"""

from __future__ import annotations

import hashlib
import re

#: The schema pglock installs into unless told otherwise.
DEFAULT_SCHEMA = "pglock"

#: Schema names pglock accepts: plain lower-case identifiers that need no quoting and are not
#: truncated by Postgres (63 bytes at most).
SCHEMA_PATTERN = re.compile(r"[a-z_][a-z0-9_]{0,62}")

#: The longest TTL the functions accept, in seconds (one day). Longer work renews.
MAX_TTL = 86400

#: SQLSTATE of ``semaphore_acquire`` when the caller's limit differs from the stored one
#: (class ``PG``: pglock's own).
LIMIT_MISMATCH = "PGL01"

#: The name registry (pglock._registry): ``<schema>.lock_names``, key -> the name pglock took
#: it for; used only while the table's comment starts with ``NAMES_MARKER`` (revision 0003).
NAMES_TABLE = "lock_names"
NAMES_MARKER = "pglock name registry"

#: Postgres identifiers (and so NOTIFY channels) are at most this many bytes.
_MAX_IDENTIFIER_BYTES = 63


def validate_schema(schema: object) -> str:
    """Return ``schema`` if it matches :data:`SCHEMA_PATTERN` and does not start with ``pg_``
    (reserved by Postgres); else ``TypeError`` (not a ``str``) or ``ValueError``."""
    if not isinstance(schema, str):
        raise TypeError(f"schema must be a str, not {type(schema).__name__}")
    schema = str.__str__(schema)  # by value (pglock._keys.exact; this module imports none)
    if not SCHEMA_PATTERN.fullmatch(schema):
        raise ValueError(
            f"invalid schema name {schema!r}: use 1 to 63 characters from a-z, 0-9 and _, "
            "not starting with a digit (for example 'pglock')"
        )
    if schema.startswith("pg_"):
        raise ValueError(f"invalid schema name {schema!r}: names starting with pg_ are reserved")
    return schema


def _channel(schema: str, suffix: str) -> str:
    # The schema part is cut (in UTF-8 bytes, on a character boundary) so that the channel
    # fits an identifier: pg_notify() refuses a longer one.
    head = schema.encode("utf-8")[: _MAX_IDENTIFIER_BYTES - len(suffix)]
    return head.decode("utf-8", "ignore") + suffix


def lease_channel(schema: str) -> str:
    """The NOTIFY channel of lease releases in ``schema`` (``<schema>_lease``); payload: the
    lease name."""
    return _channel(schema, "_lease")


def semaphore_channel(schema: str) -> str:
    """The NOTIFY channel of semaphore releases in ``schema`` (``<schema>_semaphore``);
    payload: the semaphore name."""
    return _channel(schema, "_semaphore")


def install_lock_key(schema: str) -> int:
    """The advisory-lock key that serializes installs of ``schema``: the lock-name key
    (``pglock._keys.key``) of ``pglock:install:<schema>``."""
    digest = hashlib.sha256(f"pglock:install:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def epoch_lock_key(schema: str) -> int:
    """The advisory-lock key that serializes the fencing-token jump to a new timeline's floor
    (revision 0004's ``token_epoch`` trigger): the lock-name key of ``pglock:epoch:<schema>``."""
    digest = hashlib.sha256(f"pglock:epoch:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


#: SQL, true for a schema (``n``, a pg_namespace row) where a role other than its owner and the
#: superusers may create objects, or that holds an object of such a role. Whoever may do that can
#: make pglock's functions run code of its own, with their owner's rights (an install into it),
#: or answer for them (a lease statement calling it): docs/threat-model.md, "(e) Other roles".
SCHEMA_OPEN = (
    "(EXISTS (SELECT FROM pg_catalog.aclexplode(n.nspacl) a"
    " WHERE a.privilege_type OPERATOR(pg_catalog.=) 'CREATE'"
    " AND a.grantee OPERATOR(pg_catalog.<>) n.nspowner AND NOT COALESCE((SELECT r.rolsuper"
    " FROM pg_catalog.pg_roles r WHERE r.oid OPERATOR(pg_catalog.=) a.grantee), false))"
    " OR EXISTS (SELECT FROM (SELECT proowner AS owner FROM pg_catalog.pg_proc"
    " WHERE pronamespace OPERATOR(pg_catalog.=) n.oid"
    " UNION ALL SELECT relowner FROM pg_catalog.pg_class"
    " WHERE relnamespace OPERATOR(pg_catalog.=) n.oid"
    " UNION ALL SELECT typowner FROM pg_catalog.pg_type"
    " WHERE typnamespace OPERATOR(pg_catalog.=) n.oid"
    " UNION ALL SELECT oprowner FROM pg_catalog.pg_operator"
    " WHERE oprnamespace OPERATOR(pg_catalog.=) n.oid) x"
    " JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) x.owner"
    " WHERE x.owner OPERATOR(pg_catalog.<>) n.nspowner AND NOT r.rolsuper))"
)
