"""Alembic migrations of the brain's schema, shipped in the package and run
programmatically (`dlfleet.brain.schema`); users need no alembic.ini."""
