"""Replay records and feedback.

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "replay_records",
        sa.Column("trace_id", sa.String(32), primary_key=True),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("input_sha256", sa.String(64), nullable=False),
        sa.Column("prompt_stored", sa.Boolean, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
    )
    op.create_index("ix_replay_records_created_ms", "replay_records", ["created_ms"])
    op.create_index("ix_replay_records_input_sha256", "replay_records", ["input_sha256"])
    op.create_table(
        "feedback",
        sa.Column("feedback_id", sa.String(128), primary_key=True),
        sa.Column("trace_id", sa.String(32), nullable=False),
        sa.Column("error_type", sa.String(32), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("expected_keywords", sa.Text, nullable=False),
        sa.Column("comment", sa.Text, nullable=False),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_feedback_trace_id", "feedback", ["trace_id"])
    op.create_index("ix_feedback_created_ms", "feedback", ["created_ms"])


def downgrade() -> None:
    op.drop_table("feedback")
    op.drop_table("replay_records")
