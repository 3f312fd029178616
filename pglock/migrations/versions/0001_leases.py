"""Leases: the lease table, the fencing-token sequence and the lease functions (the root).

SQL: ``pglock/sql/0001_leases.up.sql`` and ``.down.sql`` (docs/reference/sql.md).
"""

from __future__ import annotations

from psycopg import sql

from pglock._contract import MAX_TTL, lease_channel
from pglock.migrations import revision_functions, sql_text

revision = "pglock_0001"
down_revision = None
branch_labels = ("pglock",)
depends_on = None


def _names(schema: str) -> dict[str, sql.Composable]:
    s = sql.Identifier(schema)
    return {
        # Regclass literal of the sequence, resolved once per cached plan.
        "seq": sql.Literal(f"{s.as_string(None)}.lease_token"),
        "channel": sql.Literal(lease_channel(schema)),
        "max_ttl": sql.Literal(MAX_TTL),
        # The downgrade's refusal to drop live leases (dynamic SQL: the table may be gone).
        "lease_table": sql.Literal(f"{s.as_string(None)}.lease"),
        "lock_leases": sql_text("LOCK TABLE {}.lease IN ACCESS EXCLUSIVE MODE", s),
        "count_live": sql_text(
            "SELECT count(*) FROM {}.lease WHERE expires_at > pg_catalog.clock_timestamp()", s
        ),
        "drop_schema": sql_text("DROP SCHEMA {}", s),
    }


upgrade_statements, downgrade_statements, upgrade, downgrade = revision_functions(
    "0001_leases", revision, _names
)
