"""A script that fails like a Lightning or Hugging Face Trainer script: no
`@record`, so no error file of torch's, only a traceback printed to stderr.

    unrecorded_failure.py

Global rank 0 raises the same ValueError at every start (after some output of
its own, as a framework prints), the other ranks wait to be stopped.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    print("Epoch 0:   0%|          | 0/10 [00:00<?, ?it/s]", file=sys.stderr, flush=True)
    if os.environ["RANK"] == "0":
        raise ValueError("Expected input batch_size (8) to match target batch_size (4).")
    time.sleep(60)


if __name__ == "__main__":
    main()
