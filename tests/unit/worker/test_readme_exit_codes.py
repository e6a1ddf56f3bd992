"""README tells a user what a preempted `dlworker` exits with: every exit code
it gives beside SIGTERM or preemption is the one the agent returns."""

from __future__ import annotations

import re
from pathlib import Path

from dlfleet.worker.agent.phases import EXIT_PREEMPTED

README = Path(__file__).resolve().parents[3] / "README.md"
EXIT_CODE = re.compile(r"\bexit(?:s|s with| with| code)? (\d+)")


def preemption_sentences(text: str) -> list[str]:
    """The sentences that name an exit code and SIGTERM or preemption."""
    flat = " ".join(text.split())
    return [
        sentence
        for sentence in re.split(r"(?<=[.;])\s", flat)
        if re.search(r"SIGTERM|preempt", sentence, re.I) and EXIT_CODE.search(sentence)
    ]


def test_the_readme_gives_the_exit_code_a_preempted_dlworker_returns() -> None:
    sentences = preemption_sentences(README.read_text())
    assert sentences, "README says what a preempted dlworker exits with"
    for sentence in sentences:
        assert {int(code) for code in EXIT_CODE.findall(sentence)} == {EXIT_PREEMPTED}, sentence
