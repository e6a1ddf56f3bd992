"""Overlapped in-memory checkpoints on one device, in one process: what a
save costs the training step when the model lives on a GPU.

    TMPDIR=/dev/shm python bench/checkpoint_device.py      # CUDA, 6 x Linear(8192): 4.8 GB
    python bench/checkpoint_device.py --device cpu --width 1024 --batch 256

No agent and no master: the Checkpointer keeps its images in a private
folder under $TMPDIR (/dev/shm: memory-backed images, as under dlworker).
Printed: a plain copy of the state into pinned host memory (the copy's
limit); dlfleet's blocking per save (save() plus the time the next
optimizer.step() held the CPU for the copy; on CUDA that step's stream waits
for the copy on the device instead) with the time its image was copied and
complete; `torch.save` + fsync and `dcp.async_save` blocking per save;
steps/s with a checkpoint after every step (none, dlfleet, dcp.async_save,
each waiting for the previous upload); last, `ratio: X` = dcp.async_save
median blocking / dlfleet median blocking (higher is better).
bench/checkpoint.py is the multi-rank bench under the real agent and master.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import async_save

from dlfleet.worker.checkpoint.checkpointer import Checkpointer

WARMUP = 2


class Job:
    """The model, its optimizer and one training step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        self.batch, self.width = args.batch, args.width
        layers: list[torch.nn.Module] = []
        for i in range(args.layers):
            if i:
                layers.append(torch.nn.ReLU())
            layers.append(torch.nn.Linear(args.width, args.width))
        self.model = torch.nn.Sequential(*layers).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=True)
        self.generator = torch.Generator(device=self.device).manual_seed(0)
        self.step()  # AdamW's state exists from now on

    def step(self) -> None:
        x = torch.randn(self.batch, self.width, device=self.device, generator=self.generator)
        loss = self.model(x).pow(2).mean()
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.optimizer.step()
        float(loss.detach())  # a training loop's usual sync

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def tensors(self) -> list[torch.Tensor]:
        state = [v for s in self.optimizer.state.values() for v in s.values()]
        moments = [v for v in state if isinstance(v, torch.Tensor) and v.numel() > 1]
        return [p.detach() for p in self.model.parameters()] + moments

    def state_dicts(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


def plain_copy_s(job: Job, nbytes: int) -> float:
    """Every tensor of the state copied into one pinned host buffer, best of 3."""
    flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=job.device.type == "cuda")
    flat.fill_(0)
    best = float("inf")
    for _ in range(3):
        job.sync()
        started = time.perf_counter()
        at = 0
        for tensor in job.tensors():
            n = tensor.numel() * tensor.element_size()
            flat[at : at + n].view(tensor.dtype).copy_(tensor.flatten(), non_blocking=True)
            at += n
        job.sync()
        best = min(best, time.perf_counter() - started)
    return best


def dlfleet_saves(job: Job, ckpt: Checkpointer, saves: int) -> tuple[list[float], list[Any]]:
    """Blocking per save (save + the next step's hold), and the images' times."""
    blocked = []
    for i in range(WARMUP + saves):
        job.step()
        started = time.perf_counter()
        ckpt.save(i, {"model": job.model, "optim": job.optimizer})
        saved = time.perf_counter() - started
        held = ckpt.step_held_s
        job.step()
        if i >= WARMUP:
            blocked.append(saved + ckpt.step_held_s - held)
    ckpt.last_image  # noqa: B018 - waits for the last image to be finished
    times = [ckpt.image_times(i) for i in range(WARMUP, WARMUP + saves)]
    return blocked, [t for t in times if t is not None]


def torch_saves(job: Job, work: Path, saves: int) -> list[float]:
    blocked = []
    for i in range(saves):
        job.step()
        path = work / f"step-{i}.pt"
        started = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(job.state_dicts(), f)
            f.flush()
            os.fsync(f.fileno())
        blocked.append(time.perf_counter() - started)
        path.unlink()
    return blocked


class DcpSaver:
    """dcp.async_save after a step, waiting for the previous upload first (as
    its documentation asks) and removing the folder it wrote."""

    def __init__(self, job: Job, work: Path) -> None:
        self.job, self.work = job, work
        self.pending: Any = None
        self.folder: Path | None = None
        self.count = 0

    def save(self) -> float:
        self.wait()
        self.folder = self.work / f"dcp-{self.count}"
        self.count += 1
        started = time.perf_counter()
        self.pending = async_save(self.job.state_dicts(), checkpoint_id=str(self.folder))
        return time.perf_counter() - started

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def dcp_saves(job: Job, work: Path, saves: int) -> list[float]:
    saver = DcpSaver(job, work)
    blocked = []
    for i in range(WARMUP + saves):
        job.step()
        took = saver.save()
        if i >= WARMUP:
            blocked.append(took)
    saver.wait()
    return blocked


def steps_per_second(job: Job, steps: int, after_step: Callable[[int], None]) -> float:
    for i in range(WARMUP):
        job.step()
        after_step(i)
    job.sync()
    started = time.perf_counter()
    for i in range(WARMUP, WARMUP + steps):
        job.step()
        after_step(i)
    job.sync()
    return steps / (time.perf_counter() - started)


def throughput(job: Job, ckpt: Checkpointer, work: Path, steps: int) -> dict[str, float]:
    dcp = DcpSaver(job, work)
    first = 10_000  # steps of their own, after the timed saves'

    def nothing(i: int) -> None:
        """No checkpoint."""

    def with_dlfleet(i: int) -> None:
        ckpt.save(first + i, {"model": job.model, "optim": job.optimizer})

    def with_dcp(i: int) -> None:
        dcp.save()

    rates = {
        "none": steps_per_second(job, steps, nothing),
        "dlfleet": steps_per_second(job, steps, with_dlfleet),
        "dcp_async": steps_per_second(job, steps, with_dcp),
    }
    dcp.wait()
    return rates


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--saves", type=int, default=5, help="timed saves (dlfleet, DCP)")
    parser.add_argument("--torch-saves", type=int, default=2, help="timed torch.save calls")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per throughput mode")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # DCP's async_save wants a process group: one of one process.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    job = Job(args)
    nbytes = sum(t.numel() * t.element_size() for t in job.tensors())
    name = torch.cuda.get_device_name() if job.device.type == "cuda" else "cpu"
    print(f"{name}: {nbytes / 1e9:.2f} GB of state, torch {torch.__version__}", flush=True)
    copy_s = plain_copy_s(job, nbytes)
    print(f"plain copy into pinned memory: {copy_s:.3f} s, {nbytes / 1e9 / copy_s:.1f} GB/s")
    work = Path(tempfile.mkdtemp(prefix="dlfleet-ckpt-device-"))
    try:
        with Checkpointer() as ckpt:
            blocked, times = dlfleet_saves(job, ckpt, args.saves)
            copied = statistics.median(t.copied_s for t in times)
            ready = statistics.median(t.ready_s for t in times)
            print(
                f"dlfleet: blocking median {statistics.median(blocked):.4f} s "
                f"(min {min(blocked):.4f}, max {max(blocked):.4f}); the image copied in "
                f"{copied:.3f} s ({nbytes / 1e9 / copied:.1f} GB/s), complete in {ready:.3f} s",
                flush=True,
            )
            saved = torch_saves(job, work, args.torch_saves)
            print(f"torch.save + fsync: median {statistics.median(saved):.3f} s", flush=True)
            dcp = dcp_saves(job, work, args.saves)
            print(f"dcp.async_save: median {statistics.median(dcp):.3f} s", flush=True)
            rates = throughput(job, ckpt, work, args.steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("steps/s with a checkpoint after every step:")
    for mode, rate in rates.items():
        print(f"  {mode:10s} {rate:8.3f}  {rate / rates['none']:.3f} of none")
    dl = statistics.median(blocked)
    print(f"torch.save / dlfleet: {statistics.median(saved) / dl:.1f}x")
    print(f"ratio: {statistics.median(dcp) / dl:.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
