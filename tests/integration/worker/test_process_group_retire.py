"""Process groups end without a deadlock: a gloo group destroyed right after a
collective on a Python tensor can hang its process forever (gloo's
destructor joins a worker thread that waits for the GIL the destroyer holds;
the same loop with `destroy_process_group()` hung within 300 rounds here).
`retire_process_group` keeps the group's objects until its threads are idle."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LOOP = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from dlfleet.worker.elastic import runner

    torch.set_num_threads(1)
    for _ in range(int(sys.argv[1])):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = DistributedDataParallel(torch.nn.Linear(4, 4))
        model(torch.ones(2, 4)).sum().backward()
        dist.all_reduce(torch.ones(1))
        runner.retire_process_group()
        del model
    assert len(runner._retired) >= 1  # the newest are kept, the old ones went
    print("done")
    """
)


def test_hundreds_of_groups_are_retired_without_a_hang() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LOOP, "300"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]


def test_the_spares_warm_up_ends() -> None:
    code = "from dlfleet.worker.elastic import runner\nfor _ in range(30): runner.warm_up(None)"
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
