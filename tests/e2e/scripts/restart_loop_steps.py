"""A job that fails again one step after every restore, for the restart-loop
breaker's end-to-end test.

    restart_loop_steps.py OUT_DIR FAIL_AT

One rank, no process group: it restores the newest step its `Checkpointer`
finds, appends `{"round", "restored"}` to OUT_DIR/restores.jsonl (restored
-1: a fresh start), saves a step every 0.05 s, and raises a RuntimeError at
step FAIL_AT of a fresh start and at the step after the restored one of a
restore: a deterministic fault no restart fixes. Each message names the round,
so the agent's rule table does not call it the same error again (which would
fail the job before the breaker has stepped down).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from dlfleet.worker.checkpoint.checkpointer import Checkpointer


def main() -> None:
    out, fail_at = Path(sys.argv[1]), int(sys.argv[2])
    round_ = os.environ.get("DLFLEET_ROUND", os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"))
    with Checkpointer() as checkpointer:
        restored = checkpointer.load()
        start = restored.step + 1 if restored is not None else 0
        with (out / "restores.jsonl").open("a") as f:
            line = {"round": round_, "restored": restored.step if restored else -1}
            f.write(json.dumps(line) + "\n")
        failing = start if restored is not None else fail_at
        for step in range(start, fail_at + 100):
            if step == failing:
                raise RuntimeError(f"loss is NaN at step {step} (attempt of round {round_})")
            checkpointer.save(step, {"w": torch.full((4,), float(step))})
            time.sleep(0.05)


if __name__ == "__main__":
    main()
