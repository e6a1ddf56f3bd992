"""Two ranks of one node save steps; rank 1 is SIGKILLed after step 5 (as by
the OOM killer), so the agent stops rank 0 with SIGTERM: rank 0 persists the
newest step both ranks hold. No dlfleet.elastic.run and no process group, as
a Hugging Face Trainer or Lightning script under dlworker.

    killed_peer_steps.py OUT_DIR STEPS STEP_SECONDS

Rank 1 prints `killed at <time.time()>` to stderr just before it dies. The
restarted round (TORCHELASTIC_RESTART_COUNT 1) exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    sys.exit(0)  # before importing torch: the restart is not what is timed

import torch

from dlfleet import Checkpointer

KILLED_AFTER = 5


def main() -> None:
    out, steps, pause = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    rank = int(os.environ["RANK"])
    ckpt = Checkpointer(persist_every=1000, persist_dir=out / "disk")
    model = torch.nn.Linear(4, 4)
    for step in range(1, steps + 1):
        ckpt.save(step, {"model": model.state_dict(), "step": step})
        if step == KILLED_AFTER:
            while ckpt.image_times(step) is None:  # its image finished (in the background)
                time.sleep(0.01)
            (out / f"rank-{rank}-saved-{step}").touch()
        if rank == 1 and step == KILLED_AFTER:
            # The ranks train apart (no process group) and a save does not
            # wait for the other ranks: rank 0 may start later. Both hold
            # the step before rank 1 dies.
            while not (out / f"rank-0-saved-{step}").exists():
                time.sleep(0.01)
            print(f"killed at {time.time():.3f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(pause)


if __name__ == "__main__":
    main()
