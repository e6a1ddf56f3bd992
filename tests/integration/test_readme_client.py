"""README's "Talking to it" example runs, as written, against a real master:
it leases every shard of its dataset, through every epoch, and stops at the
end of the dataset (its size made small here so the test is quick)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import TOKEN, Running

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def example() -> str:
    section = README.read_text().split("## Talking to it", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's 'Talking to it' has no python example"
    return match.group(1)


def test_the_client_example_leases_the_whole_dataset(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    code = example()
    assert "size=1_000_000" in code and '"127.0.0.1:50051"' in code
    code = code.replace("size=1_000_000", "size=6_000").replace(
        '"127.0.0.1:50051"', repr(running.address)
    )
    # The example's `...` is where a user trains: count the records leased.
    code = code.replace("            ...  #", "            leased.append(answer.shard)  #")
    leased: list[Any] = []
    scope: dict[str, Any] = {"token": TOKEN, "leased": leased}
    exec(compile(code, "README.md", "exec"), scope)
    records = sum(shard.end - shard.start for shard in leased)
    assert records == 3 * 6_000  # three epochs, each record once an epoch
    assert {shard.epoch for shard in leased} == {0, 1, 2}
    scope["client"].close()
