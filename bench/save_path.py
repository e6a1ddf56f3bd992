"""What a per-step save costs a short step, stage by stage, against torch.save.

One process, no agent and no peer (what a save costs the training process
itself): the quickstart's model and optimizer (AdamW, ~5,400 parameters) and
a loader-like state, trained on batches of 32 on one thread. Each trial runs
three modes, in rotated order, for `--steps` timed steps each:

- none: the step alone;
- dlfleet: `Checkpointer(every=1)` saving the state after every step into a
  folder of /dev/shm, as under dlworker (the state built by get_state_dict,
  as the quickstart builds it);
- torch.save: the same state built the same way, `torch.save`d to a file of
  /dev/shm after every step (the plain way to keep a step in memory).

It prints the median step time of each mode, the steps/s of each saving mode
over none, the stages of dlfleet's save (the state's build, its plan, the
copy into the image, the header written), and last
`ratio: X` = torch.save's step time / dlfleet's (higher is better: above 1,
a dlfleet save costs the step less than a torch.save of the same state).

    python bench/save_path.py             # 5 trials of 2,000 steps per mode (~1 min)
    python bench/save_path.py --quick     # 2 trials of 500
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dlfleet.api.env import CHECKPOINT_DIR_ENV

MODES = ("none", "dlfleet", "torch.save")
STAGES = ("state", "plan", "copy", "header")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=None, help="trials (5; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per mode (2000; 500)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    args.trials = args.trials or (2 if args.quick else 5)
    args.steps = args.steps or (500 if args.quick else 2000)
    return args


class Stages:
    """Seconds spent in each stage of dlfleet's saves, by wrapping the
    functions that do them (the wrappers' own cost is counted too)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.on = False

    def wrap(self, owner: Any, name: str, stage: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(*args, **kwargs)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - started

        setattr(owner, name, timed)

    @classmethod
    def of_saves(cls, image: Any) -> Stages:
        stages = cls()
        stages.wrap(image, "plan_state", "plan")  # as image.py calls it
        stages.wrap(image, "_copy_items", "copy")
        stages.wrap(image.PendingImage, "finish", "header")
        return stages

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False


def main() -> int:
    args = parse_args()
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    images = tempfile.mkdtemp(prefix="dlfleet-bench-save-", dir=shm)
    try:
        return measure(args, images)
    finally:
        shutil.rmtree(images, ignore_errors=True)


def measure(args: argparse.Namespace, images: str) -> int:
    # The folder dlworker's agent gives its workers (no agent here: nothing
    # is announced or replicated; the process's own cost only).
    os.environ[CHECKPOINT_DIR_ENV] = images

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dlfleet import Checkpointer
    from dlfleet.worker.checkpoint import image

    torch.set_num_threads(1)
    stages = Stages.of_saves(image)
    torch.manual_seed(0)
    # The quickstart's model (examples/quickstart/train.py).
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, labels = torch.randn(32, 16), torch.randint(0, 4, (32,))
    loader = {"dataset": "bench", "epoch": 0, "batches": 0, "records": 0}
    target = Path(images) / "torch-save.pt"

    def train_step() -> None:
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    def state(step: int) -> dict[str, Any]:
        started = time.perf_counter()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        loader["batches"] = step
        built = {"model": model_state, "optimizer": optimizer_state, "loader": dict(loader)}
        if stages.on:
            stages.seconds["state"] += time.perf_counter() - started
        return built

    with Checkpointer(every=1, persist_every=0) as checkpointer:
        steps = [0]

        def run(mode: str) -> Callable[[], None]:
            def one() -> None:
                train_step()
                steps[0] += 1
                if mode == "dlfleet":
                    checkpointer.save(steps[0], state(steps[0]), overlap=(model, optimizer))
                elif mode == "torch.save":
                    torch.save(state(steps[0]), target)

            return one

        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        saves = 0
        for trial in range(args.trials):
            order = MODES[trial % 3 :] + MODES[: trial % 3]
            for mode in order:
                one = run(mode)
                for _ in range(50):  # untimed: warm caches, plans and files
                    one()
                counting = stages.counting() if mode == "dlfleet" else _nothing()
                with counting:
                    started = time.perf_counter()
                    for _ in range(args.steps):
                        one()
                    elapsed = time.perf_counter() - started
                saves += args.steps if mode == "dlfleet" else 0
                times[mode].append(elapsed / args.steps)
            print(
                f"trial {trial + 1}: "
                + ", ".join(f"{m} {times[m][-1] * 1e3:.3f} ms/step" for m in MODES),
                flush=True,
            )

    report(times, stages, saves)
    return 0


def report(times: dict[str, list[float]], stages: Stages, saves: int) -> None:
    step_ms = {mode: statistics.median(values) * 1e3 for mode, values in times.items()}
    print()
    print(f"{'mode':<12}{'ms/step':>10}{'steps/s of none':>18}")
    for mode in MODES:
        print(f"{mode:<12}{step_ms[mode]:>10.3f}{step_ms['none'] / step_ms[mode]:>18.3f}")
    print()
    spent = ", ".join(f"{s} {stages.seconds[s] / saves * 1e3:.3f}" for s in STAGES)
    print(f"dlfleet's save, per step (ms): {spent}")
    print(f"ratio: {step_ms['torch.save'] / step_ms['dlfleet']:.2f}")


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    raise SystemExit(main())
