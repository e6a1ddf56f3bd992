"""The examples users start from run to completion, as the README says:
`dlmaster --job-config examples/<name>/job.yaml` (the job's workdir moved
to a temporary folder so that the checkout stays clean)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from harness import JobProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["quickstart", "fsdp"])
def test_the_example_job_runs_to_completion(tmp_path: Path, name: str) -> None:
    config = yaml.safe_load((EXAMPLES / name / "job.yaml").read_text())
    config["command"] = str(EXAMPLES / name / config["command"])
    config["workdir"] = str(tmp_path / "work")
    config["display"] = "plain"
    job = JobProcess(tmp_path, config).start()
    code, out, err = job.finish(timeout=200)
    assert code == 0, f"{err[-3000:]}\n{out[-3000:]}"
    assert f"job {config['name']} succeeded" in out
    final = re.search(r"done: 2 epochs, final loss ([0-9.]+)", out)
    assert final is not None, out[-3000:]
    assert float(final.group(1)) < 0.5  # it learned something
    assert (tmp_path / "work" / "checkpoints").is_dir()


def test_the_quickstart_still_runs_under_plain_torchrun(tmp_path: Path) -> None:
    """No dlfleet master: rank-based sharding, and a one-line warning."""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    script = [str(EXAMPLES / "quickstart" / "train.py"), "--epochs", "1", "--size", "512"]
    done = subprocess.run(
        [*torchrun, *script, "--checkpoint-dir", str(tmp_path / "checkpoints")],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: 1 epochs" in done.stdout
    assert "ShardedDataLoader: no dlfleet master (DLFLEET_MASTER is unset)" in done.stderr


@pytest.mark.parametrize(("name", "steps"), [("hf", 64), ("lightning", 32)])
def test_the_framework_examples_run_to_completion(tmp_path: Path, name: str, steps: int) -> None:
    """examples/hf (DLFleetTrainer) and examples/lightning (the environment,
    the checkpoint callback, the loader), on a smaller dataset than theirs."""
    config = yaml.safe_load((EXAMPLES / name / "job.yaml").read_text())
    config["command"] = str(EXAMPLES / name / config["command"])
    config["args"] = ["--epochs", "2", "--size", "1024"]
    config["workdir"] = str(tmp_path / "work")
    config["display"] = "plain"
    job = JobProcess(tmp_path, config).start()
    code, out, err = job.finish(timeout=200)
    assert code == 0, f"{err[-3000:]}\n{out[-3000:]}"
    assert f"job {config['name']} succeeded" in out
    assert re.search(r"done: 2 epochs, final loss [0-9.]+", out), out[-3000:]
    # 1,024 records, 2 ranks of 16 (hf) or 32 (lightning): the last step checkpointed
    assert f"checkpoints: step {steps} saved" in out, out[-3000:]
