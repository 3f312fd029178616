"""The name registry: which lock name each advisory-lock key stands for.

SQL: ``pglock/sql/0003_lock_names.up.sql`` and ``.down.sql`` (docs/reference/sql.md).
"""

from __future__ import annotations

from psycopg import sql

from pglock._contract import install_lock_key
from pglock.migrations import revision_functions

revision = "pglock_0003"
down_revision = "pglock_0002"
branch_labels = None
depends_on = None


def _names(schema: str) -> dict[str, sql.Composable]:
    return {
        "s": sql.Identifier(schema),
        "rev": sql.Literal(revision),
        "lock": sql.Literal(install_lock_key(schema)),
    }


upgrade_statements, downgrade_statements, upgrade, downgrade = revision_functions(
    "0003_lock_names", _names
)
