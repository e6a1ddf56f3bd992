"""`Checkpointer(every="auto")` on two real processes in a gloo group whose
steps differ in length on purpose: each rank measures its own saves, and
both save exactly the same steps, at the larger interval either needed (one
all-reduce at the same save on both)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from integration.checkpoint.test_final_persist import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys, time
    import torch, torch.distributed as dist
    from dlfleet import Checkpointer
    from dlfleet.worker.checkpoint import checkpointer as module

    module.AUTO_SAMPLES = 8
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saved = []
    with Checkpointer(every="auto") as ckpt:
        for step in range(1, 80):
            before = ckpt.saves
            ckpt.save(step, {"w": torch.full((4096,), float(step)), "rank": rank})
            if ckpt.saves > before:
                saved.append(step)
            # Rank 1's steps are longer: on its own it would save more often.
            time.sleep(0.004 if rank == 0 else 0.012)
        print("SAVED " + json.dumps({"rank": rank, "every": ckpt.every, "saved": saved}),
              file=sys.stderr, flush=True)
    dist.destroy_process_group()
    os._exit(0)
    """
)


def test_ranks_with_different_costs_save_the_same_steps(tmp_path: Path) -> None:
    errors = run_ranks(tmp_path / "disk", late_s=0.0, script=SCRIPT)
    said = [
        json.loads(line.removeprefix("SAVED "))
        for err in errors
        for line in err.splitlines()
        if line.startswith("SAVED ")
    ]
    assert sorted(s["rank"] for s in said) == [0, 1], errors
    rank0, rank1 = sorted(said, key=lambda s: s["rank"])
    assert rank0["every"] == rank1["every"] > 1
    assert rank0["saved"] == rank1["saved"]
    assert rank0["saved"][:9] == list(range(1, 10))
    assert 'every="auto": saving every' in errors[0]
