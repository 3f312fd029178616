"""The name registry: which lock name each advisory-lock key stands for.

SQL: ``pglock/sql/0003_lock_names.up.sql`` and ``.down.sql`` (docs/reference/sql.md).
"""

from __future__ import annotations

from pglock.migrations import revision_functions

revision = "pglock_0003"
down_revision = "pglock_0002"
branch_labels = None
depends_on = None


upgrade_statements, downgrade_statements, upgrade, downgrade = revision_functions(
    "0003_lock_names", revision
)
