"""A deliberately slow revision that also commits on its own (CREATE INDEX CONCURRENTLY)."""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("SELECT pg_sleep(1)")
    op.execute("INSERT INTO applied (revision, pid) VALUES ('0002', pg_backend_pid())")
    # Commits Alembic's transaction; the migration lock lives elsewhere and stays held.
    with op.get_context().autocommit_block():
        op.execute("CREATE INDEX CONCURRENTLY item_v_idx ON item (v)")
    op.execute("INSERT INTO applied (revision, pid) VALUES ('0002-after-concurrently', "
               "pg_backend_pid())")


def downgrade() -> None:
    op.execute("DROP INDEX item_v_idx")
