"""Semaphores: the stored limit of each semaphore and its permit rows, and their functions.

SQL: ``pglock/sql/0002_semaphores.up.sql`` and ``.down.sql`` (docs/reference/sql.md).
"""

from __future__ import annotations

from psycopg import sql

from pglock._contract import LIMIT_MISMATCH, MAX_TTL, semaphore_channel
from pglock.migrations import revision_functions, sql_text

revision = "pglock_0002"
down_revision = "pglock_0001"
branch_labels = None
depends_on = None


def _names(schema: str) -> dict[str, sql.Composable]:
    s = sql.Identifier(schema)
    return {
        "channel": sql.Literal(semaphore_channel(schema)),
        "max_ttl": sql.Literal(MAX_TTL),
        "mismatch": sql.Literal(LIMIT_MISMATCH),
        # The downgrade's refusal to drop live permits (dynamic SQL: the table may be gone).
        "permit_table": sql.Literal(f"{s.as_string(None)}.semaphore_permit"),
        "lock_permits": sql_text(
            "LOCK TABLE {0}.semaphore, {0}.semaphore_permit IN ACCESS EXCLUSIVE MODE", s
        ),
        "count_live": sql_text(
            "SELECT count(*) FROM {}.semaphore_permit"
            " WHERE expires_at > pg_catalog.clock_timestamp()",
            s,
        ),
    }


upgrade_statements, downgrade_statements, upgrade, downgrade = revision_functions(
    "0002_semaphores", revision, _names
)
