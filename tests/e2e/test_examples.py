"""The examples users start from run to completion, as the README says:
`dlmaster --job-config examples/<name>/job.yaml` (the job's workdir moved
to a temporary folder so that the checkout stays clean)."""

from __future__ import annotations

import re
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
