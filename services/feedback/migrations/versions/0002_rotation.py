"""Rotation decisions and retrain requests (services/feedback/rotation).

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    op.create_table(
        "rotation_decisions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("starts_at", sa.String(64), nullable=False),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("rule", sa.String(200), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("labels", sa.Text, nullable=False),
        sa.Column("snapshot", sa.Text, nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("result", sa.Text, nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("reverts", sa.Integer, nullable=True),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
        sa.Column("applied_ms", sa.BigInteger, nullable=True),
        sa.UniqueConstraint("fingerprint", "starts_at", "phase", name="uq_rotation_decisions_alert"),
    )
    op.create_index("ix_rotation_decisions_rule", "rotation_decisions", ["rule"])
    op.create_index("ix_rotation_decisions_action", "rotation_decisions", ["action"])
    op.create_index("ix_rotation_decisions_outcome", "rotation_decisions", ["outcome"])
    op.create_index("ix_rotation_decisions_created_ms", "rotation_decisions", ["created_ms"])
    op.create_table(
        "rotation_retrain_requests",
        sa.Column("decision_id", sa.Integer, sa.ForeignKey("rotation_decisions.id"), primary_key=True),
        sa.Column("adapter", sa.String(200), primary_key=True),
        sa.Column("version", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("rotation_retrain_requests")
    op.drop_table("rotation_decisions")
