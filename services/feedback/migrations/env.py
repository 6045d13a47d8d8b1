"""Alembic environment: runs migrations on the connection services/feedback/db.py hands over."""
from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None)
with context.begin_transaction():
    context.run_migrations()
