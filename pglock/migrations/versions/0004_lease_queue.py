"""Leases: the waiter queue (``lease_waiter``) and the ``_v4`` functions that hand a lease to
the queue's head in the releasing transaction; fencing tokens above the WAL timeline's floor
(the ``token_epoch`` trigger), so that no failover makes them go back.

SQL: ``pglock/sql/0004_lease_queue.up.sql`` and ``.down.sql`` (docs/reference/sql.md).
"""

from __future__ import annotations

from psycopg import sql

from pglock._contract import MAX_TTL, epoch_lock_key, lease_channel
from pglock.migrations import revision_functions

revision = "pglock_0004"
down_revision = "pglock_0003"
branch_labels = None
depends_on = None

#: The expiry (seconds) of a grant handed to a waiter by a release: the waiter may have died
#: within its last liveness window; its keepalive extends the grant to the full TTL.
HANDOFF_WINDOW = 1.0


def _names(schema: str) -> dict[str, sql.Composable]:
    s = sql.Identifier(schema)
    return {
        "seq": sql.Literal(f"{s.as_string(None)}.lease_token"),
        "channel": sql.Literal(lease_channel(schema)),
        "epoch_lock": sql.Literal(epoch_lock_key(schema)),
        "max_ttl": sql.Literal(MAX_TTL),
        "window": sql.Literal(HANDOFF_WINDOW),
    }


upgrade_statements, downgrade_statements, upgrade, downgrade = revision_functions(
    "0004_lease_queue", revision, _names
)
