"""Opening the brain's database says one line when its schema is migrated,
and nothing when it is at head: Alembic's own INFO lines (its plugins, its
context, each revision) stay out of a job's output at the default verbosity.

A fresh process, so that Alembic's import-time lines count too."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=sys.argv[2], format="%(levelname)s %(name)s %(message)s")
    from dlfleet.brain import schema
    print("--- first", file=sys.stderr, flush=True)
    schema.migrate(sys.argv[1])
    print("--- again", file=sys.stderr, flush=True)
    schema.migrate(sys.argv[1])
    """
)


def migrate_twice(url: str, level: str = "INFO") -> tuple[str, str]:
    """What a process logs at `level` migrating `url` from empty, then at head."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, url, level],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    before, _, rest = done.stderr.partition("--- first\n")
    first, _, again = rest.partition("--- again\n")
    return before + first, again


def test_a_migration_says_one_line_and_a_database_at_head_says_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'brain.db'}"
    first, again = migrate_twice(url)
    lines = first.strip().splitlines()
    assert len(lines) == 1, first
    assert lines[0].startswith("INFO dlfleet.brain.schema ")
    assert "upgraded" in lines[0] and "from empty" in lines[0], lines
    assert again == "", again


def test_alembic_says_what_it_does_at_debug(tmp_path: Path) -> None:
    first, _ = migrate_twice(f"sqlite:///{tmp_path / 'brain.db'}", level="DEBUG")
    assert "INFO alembic.runtime.migration Running upgrade" in first
