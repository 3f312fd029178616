"""Leases: revision 0004's internal helpers (``hand_over_v4``, ``take_over_v4``) run with their
caller's rights, so a role granted EXECUTE on the schema's functions cannot call them directly;
its ``token_epoch`` trigger fires whatever the session's ``session_replication_role``.

SQL: ``pglock/sql/0005_internal_helpers.up.sql`` and ``.down.sql`` (docs/reference/sql.md).
"""

from __future__ import annotations

from pglock.migrations import revision_functions

revision = "pglock_0005"
down_revision = "pglock_0004"
branch_labels = None
depends_on = None


upgrade_statements, downgrade_statements, upgrade, downgrade = revision_functions(
    "0005_internal_helpers", revision
)
