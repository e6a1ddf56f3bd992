"""Every apt-get call of the set-up scripts waits for dpkg's lock: the
machine's own apt (or a set-up running beside) may hold it, and a call that
fails at once failed a fresh clone's CI (`Unable to acquire the dpkg
frontend lock`)."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# The sub-commands that take dpkg's or the lists' lock.
_LOCKING = re.compile(r"\bapt-get\b(?=[^|;&]*\b(update|install|upgrade|remove)\b)")


def commands(text: str) -> list[str]:
    """The script's lines, with continued lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.split("#", 1)[0] for line in joined.splitlines()]


def test_every_apt_get_that_locks_waits_for_the_lock() -> None:
    calls = [
        (script.name, line.strip())
        for script in sorted(SCRIPTS.glob("*.sh"))
        for line in commands(script.read_text())
        if _LOCKING.search(line)
    ]
    assert len(calls) >= 5, calls  # setup.sh's and kube_env.sh's, at least
    unbounded = [call for call in calls if "DPkg::Lock::Timeout=" not in call[1]]
    assert not unbounded, unbounded
