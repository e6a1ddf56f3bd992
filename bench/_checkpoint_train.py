"""The training script of the checkpoint benchmark (bench/checkpoint.py).

Run as the ranks of one trial under `dlworker` (dlfleet's node agent, with a
dlfleet master): `--layers` Linear(`--width`, `--width`) layers with ReLUs
between them, trained with AdamW on a small random batch. The model is
replicated, not wrapped in DDP: every rank computes the same step from the
same seed, and a one-element all_reduce after each step keeps the ranks in
lockstep as DDP's gradient all_reduce would, without moving 400 MB of
gradients over gloo per step (the point is the checkpoint, not the training;
for the same reason AdamW is the fused one).

For each method of `--methods`, in that order, it runs `--warmup` untimed and
then `--saves` timed saves, one training step before each, and records the
time the training thread is held by each save:

* `dlfleet`: `Checkpointer.save(step, state, overlap=(model, optimizer))`,
  the state dicts built before the timed call as for every other method,
  in-memory, not persisted (persist_every=0), overlapped: the parameters and
  AdamW's moments are copied into this rank's image in the agent's shared
  memory while the next step's forward and backward run. Its blocking time is
  the save's own (the wait for the previous step's commit when it is not back
  yet, the copy of anything not deferred) plus the time the next step's
  `optimizer.step()` waited for the copy. Also recorded: when the image's
  copy was done and when it existed (checksums and header written), from the
  start of its copy.
* `torch_save`: rank 0 only (what DDP users do: the state is replicated),
  `torch.save` into a new file of the workdir, flush and fsync; the other
  ranks hold at the next step's all_reduce meanwhile. The previous file is
  removed after the save, untimed.
* `torch_save_nosync` (not in the default set): the same without fsync; the
  fsync follows untimed, so that no dirty page is left for the next save.
* `dcp_async`: `torch.distributed.checkpoint.async_save(state, checkpoint_id=
  <new folder>)` with its defaults (a thread, a fresh CPU staging copy, a
  FileSystemWriter that fsyncs) on every rank, over a gloo group of its own:
  the time until it returns (the staging copy). The next training step runs
  while the upload goes on; the future is then waited for (recorded apart,
  with the upload's whole duration) before the next save.

Once per trial, the reference for the copy's speed: a plain memcpy (one
thread, ctypes.memmove) of every tensor of the state into one buffer of the
same size, best of 3.

Then steps/s with a checkpoint every step (`--throughput-steps` steps per
mode on batches of `--throughput-batch`, after 2 untimed ones, order rotated
by trial; the time in `optimizer.step()` recorded too): no checkpoint, dlfleet's
save every step, dcp.async_save every step (each waiting for the previous
one's upload, as its documentation asks before the next save). With
`--long-step-s S` the phase runs again with S seconds of sleep added to each
step (a long step whose compute is on a device: the CPU idles meanwhile);
each throughput record names its `pace`, short or long.

After a method's saves, one more training step (so the live state differs),
then the restore of the newest checkpoint into the live model and optimizer,
timed on every rank from a common barrier: `Checkpointer.load(template)` from
memory; `torch.load` + `load_state_dict` of the torch.save file, and
`dcp.load` + `load_state_dict` of the DCP folder, both first with the files
evicted from the page cache (posix_fadvise DONTNEED, after their fsync:
a cold read from the disk) and then again from the page cache. Each restore is
checked against a fingerprint of the saved state.

Every record is one JSON line appended (O_APPEND, one write each) to
`--results`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save

from dlfleet import Checkpointer, elastic

_STARTED = time.monotonic()
METHODS = ("dlfleet", "torch_save", "torch_save_nosync", "dcp_async")
THROUGHPUT_MODES = ("none", "dlfleet", "dcp_async")
DCP_WAIT_S = 300.0
SAMPLE_S = 0.05


class Stopwatch:
    """Wall time, and CPU time of this thread (what it got of the machine), of a block."""

    def __enter__(self) -> Stopwatch:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.thread_time() - self.cpu


class Results:
    """JSON lines appended to the results file, one write() each."""

    def __init__(self, path: str, trial: int, rank: int) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._base = {"trial": trial, "rank": rank}

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, **self._base, **fields}) + "\n"
        os.write(self._fd, line.encode())

    def close(self) -> None:
        os.close(self._fd)


class MemorySampler:
    """Peaks of this process's resident memory (anonymous, shared-memory
    pages) and of the bytes in the agent's image folder, per phase."""

    def __init__(self, shm_dir: Path | None) -> None:
        self._shm_dir = shm_dir
        self._lock = threading.Lock()
        self._peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mem-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, float]:
        found: dict[str, float] = {}
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                name, _, rest = line.partition(":")
                if name in ("RssAnon", "RssShmem", "RssFile"):
                    found[name] = int(rest.split()[0]) / 1024.0
        if self._shm_dir is not None:
            found["shm_folder"] = _folder_bytes(self._shm_dir) / 2**20
        return found

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            sample = self.sample()
            with self._lock:
                for key, value in sample.items():
                    self._peaks[key] = max(self._peaks.get(key, 0.0), value)

    def phase(self) -> dict[str, float]:
        """The peaks since the previous call (in MiB), one last sample included."""
        sample = self.sample()
        with self._lock:
            peaks, self._peaks = self._peaks, {}
        return {k: max(peaks.get(k, 0.0), v) for k, v in sample.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _folder_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue  # replaced while we looked
    return total


def _files(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
    elif path.is_dir():
        yield from (p for p in sorted(path.rglob("*")) if p.is_file())


def evict(path: Path) -> None:
    """Drop the (clean: fsynced) pages of a file or folder from the page cache."""
    for file in _files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _step_of(path: Path) -> int:
    """The step of a `step-<N>.pt` file or `step-<N>` folder that a save wrote."""
    return int(path.name.removeprefix("step-").removesuffix(".pt"))


def remove(path: Path | None) -> None:
    if path is None:
        return
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--results", required=True, help="JSON lines file (appended to)")
    parser.add_argument("--workdir", required=True, help="where torch.save and DCP write")
    parser.add_argument("--methods", required=True, help=f"comma-separated, of {METHODS}")
    parser.add_argument("--trial", type=int, default=0)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="untimed saves per method")
    parser.add_argument("--saves", type=int, default=5, help="timed saves per method")
    parser.add_argument("--shm-dir", default="", help="the agent's image folder (measured)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--pg-timeout", type=float, default=300.0, help="gloo timeout, seconds")
    parser.add_argument(
        "--throughput-steps", type=int, default=10, help="timed steps per mode (0: no phase)"
    )
    parser.add_argument(
        "--throughput-batch", type=int, default=512, help="the batch of the throughput phase"
    )
    parser.add_argument(
        "--long-step-s",
        type=float,
        default=0.0,
        help="seconds of sleep added to each step of a second throughput phase (0: none)",
    )
    args = parser.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {METHODS}")
    return args


class Job:
    """The model, its optimizer and the checkpointer of one rank; the trial's loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        self.args = args
        self.device = torch.device("cpu")
        if args.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        layers: list[torch.nn.Module] = []
        for i in range(args.layers):
            if i:
                layers.append(torch.nn.ReLU())
            layers.append(torch.nn.Linear(args.width, args.width))
        self.model = torch.nn.Sequential(*layers).to(self.device)
        # Fused, and gradients kept allocated: a step of ~0.3 s instead of ~2.5 s
        # on one thread, so that the trial's time goes to the checkpoints.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.checkpointer = Checkpointer(persist_every=0)
        self.sampler = MemorySampler(Path(args.shm_dir) if args.shm_dir else None)
        self.built_s = time.monotonic() - _STARTED
        self.step = 0
        self._generator = torch.Generator().manual_seed(1234)
        self._sync = torch.zeros(1)
        self.optimizer_s = 0.0  # time in optimizer.step(), in total

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def fingerprint(self) -> float:
        """A cheap digest of the live state: the first 1024 values of each tensor."""
        total = 0.0
        for tensor in _tensors(self.state()):
            total += float(tensor.detach().flatten()[:1024].double().sum())
        return total

    def train_step(self, batch_size: int | None = None) -> None:
        size = self.args.batch if batch_size is None else batch_size
        batch = torch.randn(size, self.args.width, generator=self._generator)
        batch = batch.to(self.device)
        loss = self.model(batch).pow(2).mean()
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        started = time.perf_counter()
        self.optimizer.step()  # under dlfleet, also the wait for an overlapped copy
        self.optimizer_s += time.perf_counter() - started
        self._sync.fill_(float(loss))
        dist.all_reduce(self._sync)  # lockstep, as DDP's gradient all_reduce
        self.step += 1

    def train(self, attempt: elastic.Attempt) -> None:
        results = Results(self.args.results, self.args.trial, attempt.rank)
        group = dist.new_group(backend="gloo")  # DCP's background collectives, apart
        self.train_step()  # AdamW's state exists from now on
        results.write(
            "state",
            bytes=sum(t.numel() * t.element_size() for t in _tensors(self.state())),
            params=sum(p.numel() for p in self.model.parameters()),
            tensors=sum(1 for _ in _tensors(self.state())),
            world=attempt.world_size,
            built_s=self.built_s,
            pid=os.getpid(),
        )
        results.write("memcpy", seconds=self.memcpy_s(), bytes=_state_bytes(self.state()))
        for method in self.args.methods:
            self.run_method(Saver(self, method, attempt.rank, group), results)
        if self.args.throughput_steps:
            modes = list(THROUGHPUT_MODES)
            shift = self.args.trial % len(modes)
            paces = [("short", 0.0)]
            if self.args.long_step_s > 0:
                paces.append(("long", self.args.long_step_s))
            for pace, sleep_s in paces:
                for mode in modes[shift:] + modes[:shift]:
                    saver = Saver(self, "dcp_async", attempt.rank, group)
                    self.run_throughput(mode, saver, results, pace, sleep_s)
        results.write("done", seconds=time.monotonic() - _STARTED, cpu_s=time.process_time())
        results.close()

    def memcpy_s(self) -> float:
        """A plain memcpy of the whole state (one thread), best of 3: the
        copy's physical limit on this machine."""
        tensors = [t for t in _tensors(self.state()) if t.device.type == "cpu"]
        total = sum(t.numel() * t.element_size() for t in tensors)
        buffer = torch.empty(total, dtype=torch.uint8)
        buffer.fill_(0)  # its pages exist before the timed copies
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            at = buffer.data_ptr()
            for tensor in tensors:
                nbytes = tensor.numel() * tensor.element_size()
                ctypes.memmove(at, tensor.data_ptr(), nbytes)
                at += nbytes
            best = min(best, time.perf_counter() - started)
        return best

    def run_method(self, saver: Saver, results: Results) -> None:
        method = saver.method
        self.sampler.phase()
        at_start = self.sampler.sample()
        digests: dict[int, float] = {}  # of the state each save saved, by step
        record: dict[str, Any] | None = None  # the previous save's, written after the next save
        for index in range(self.args.warmup + self.args.saves):
            self.held_step(record)
            saver.before_save()
            dist.barrier()
            digests[self.step] = self.fingerprint()
            blocked, extra = saver.save(self.step, self.state())
            if record is not None:
                results.write("save", **saver.figures(record))
            record = {
                "method": method,
                "index": index,
                "warmup": index < self.args.warmup,
                "step": self.step,
                "blocked_s": blocked,
                **extra,
            }
        self.held_step(record)  # the live state moves on; the restore must bring it back
        if record is not None:
            results.write("save", **saver.figures(record, last=True))
        saver.before_save()
        peaks = self.sampler.phase()
        plan = saver.restores()
        results.write(
            "memory",
            method=method,
            disk_bytes=saver.disk_bytes,
            **peaks,
            **{f"start_{k}": v for k, v in at_start.items()},
        )
        for source, restore in plan:
            dist.barrier()
            started = time.perf_counter()
            step = restore()
            took = time.perf_counter() - started
            ok = self.fingerprint() == digests.get(step)
            results.write("restore", method=method, source=source, seconds=took, ok=ok, step=step)
            self.train_step()
        saver.finish()

    def held_step(self, record: dict[str, Any] | None) -> None:
        """A training step; the time its optimizer step waited for an
        overlapped copy is the previous save's too."""
        before = self.checkpointer.step_held_s
        self.train_step()
        if record is not None:
            held = self.checkpointer.step_held_s - before
            record["held_s"] = held
            record["blocked_s"] += held

    def run_throughput(
        self, mode: str, dcp: Saver, results: Results, pace: str = "short", sleep_s: float = 0.0
    ) -> None:
        """Steps/s with a checkpoint after every step (`mode`: none, dlfleet
        or dcp_async), the slower rank's, over `--throughput-steps` steps,
        each step `sleep_s` longer (a device's compute, the CPU idle)."""
        steps = self.args.throughput_steps
        for index in range(2 + steps):
            if index == 2:
                dist.barrier()
                started = time.perf_counter()
                optimizer_s = self.optimizer_s
            self.train_step(self.args.throughput_batch)
            if sleep_s:
                time.sleep(sleep_s)
            if mode == "dlfleet":
                self.checkpointer.save(self.step, {"model": self.model, "optim": self.optimizer})
            elif mode == "dcp_async":
                dcp.before_save()
                dcp.save(self.step, self.state())
        dcp.before_save()
        dist.barrier()
        seconds = time.perf_counter() - started
        results.write(
            "throughput",
            mode=mode,
            steps=steps,
            seconds=seconds,
            optimizer_s=self.optimizer_s - optimizer_s,
            batch=self.args.throughput_batch,
            pace=pace,
            sleep_s=sleep_s,
        )
        dcp.finish()

    def close(self) -> None:
        self.sampler.close()
        self.checkpointer.close()


class Saver:
    """One method's save, the bookkeeping around it, and its restores."""

    def __init__(self, job: Job, method: str, rank: int, group: dist.ProcessGroup) -> None:
        self.job = job
        self.method = method
        self.rank = rank
        self.group = group
        self.folder = Path(job.args.workdir) / method
        self.folder.mkdir(parents=True, exist_ok=True)
        self.last: Path | None = None  # the newest checkpoint written
        self.previous: Path | None = None  # DCP: the one before, removed after the upload
        self.pending: Future[Any] | None = None
        self.pending_started = 0.0
        self.pending_done = 0.0
        self.upload: dict[str, float] = {}  # the last upload's figures, for the next record
        self.disk_bytes = 0  # of the newest checkpoint, on disk (rank 0: all of it)
        self.saved_step = -1  # dlfleet: the step of the last save

    def before_save(self) -> None:
        """A DCP upload still going on is finished first (recorded apart)."""
        if self.pending is None:
            return
        started = time.perf_counter()
        self.pending.result(timeout=DCP_WAIT_S)
        waited = time.perf_counter() - started
        self.upload = {
            "upload_wait_s": waited,
            "upload_s": self.pending_done - self.pending_started,
        }
        self.pending = None
        if self.rank == 0:
            remove(self.previous)
        self.previous = None

    def save(self, step: int, live: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """(the wall time the save held this thread, figures for its record)"""
        if self.method == "dlfleet":
            ckpt = self.job.checkpointer
            before = ckpt.blocked_s
            with Stopwatch() as held:
                ckpt.save(step, live, overlap=(self.job.model, self.job.optimizer))
            self.saved_step = step
            return held.wall, {"cpu_s": held.cpu, "checkpointer_blocked_s": ckpt.blocked_s - before}
        if self.method.startswith("torch_save"):
            return self._torch_save(step, live)
        return self._dcp_async_save(step, live)

    def figures(self, record: dict[str, Any], last: bool = False) -> dict[str, Any]:
        """`record` with dlfleet's image times, once the next save returned
        (which waited for the image to be finished; `last`: wait here)."""
        if self.method != "dlfleet":
            return record
        ckpt = self.job.checkpointer
        if last:
            ckpt.last_image  # noqa: B018 - waits for the image to be finished
        times = ckpt.image_times(record["step"])
        if times is None:
            return record
        return {**record, "copied_s": times.copied_s, "ready_s": times.ready_s}

    def _torch_save(self, step: int, live: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        if self.rank != 0:
            return 0.0, {"saved": False}
        path = self.folder / f"step-{step}.pt"
        sync = self.method == "torch_save"
        with Stopwatch() as held, open(path, "wb") as f:
            torch.save(live, f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        if not sync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        remove(self.last)
        self.last = path
        return held.wall, {"cpu_s": held.cpu, "saved": True, "bytes": path.stat().st_size}

    def _dcp_async_save(self, step: int, live: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        extra, self.upload = self.upload, {}
        folder = self.folder / f"step-{step}"
        started = time.perf_counter()
        with Stopwatch() as held:
            future = async_save(live, checkpoint_id=str(folder), process_group=self.group)
        assert isinstance(future, Future)  # the default stager stages synchronously

        def done(_: Future[Any]) -> None:
            self.pending_done = time.perf_counter()

        self.pending, self.pending_started = future, started
        future.add_done_callback(done)
        self.previous, self.last = self.last, folder
        return held.wall, {**extra, "cpu_s": held.cpu}

    def restores(self) -> list[tuple[str, Callable[[], int]]]:
        """(source, a restore that returns the step it brought back) of this method."""
        if self.method == "dlfleet":
            # Saves do not wait for their commit; the restore is of the last
            # save once it is committed (untimed: a restore comes after a
            # failure, seconds after the saves).
            deadline = time.monotonic() + 30.0
            ckpt = self.job.checkpointer
            while ckpt.committed_step < self.saved_step and time.monotonic() < deadline:
                time.sleep(0.01)
            return [("memory", self._load_dlfleet)]
        names: list[Any] = [str(self.last) if self.last is not None else None]
        dist.broadcast_object_list(names, src=0)  # torch.save: rank 0's file
        last = Path(str(names[0]))
        if self.rank == 0:
            self.disk_bytes = sum(f.stat().st_size for f in _files(last))
        evict(last)
        load = self._load_full if self.method.startswith("torch_save") else self._load_dcp
        return [("disk-cold", lambda: load(last)), ("disk-warm", lambda: load(last))]

    def _load_dlfleet(self) -> int:
        """The newest committed step: the last save's, unless its commit (every
        rank's notice through the agent to the master) is still on its way."""
        restored = self.job.checkpointer.load(self.job.state())
        if restored is None or restored.source != "memory":
            raise RuntimeError(f"dlfleet restored {restored and restored.source}, not memory")
        self.job.optimizer.load_state_dict(restored.state["optim"])
        return int(restored.step)

    def _load_full(self, path: Path) -> int:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        self.job.model.load_state_dict(loaded["model"])
        self.job.optimizer.load_state_dict(loaded["optim"])
        return _step_of(path)

    def _load_dcp(self, folder: Path) -> int:
        template = self.job.state()
        dcp_load(template, checkpoint_id=str(folder))
        self.job.model.load_state_dict(template["model"])
        self.job.optimizer.load_state_dict(template["optim"])
        return _step_of(folder)

    def finish(self) -> None:
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(self.folder, ignore_errors=True)
        dist.barrier()  # gone before another rank's next Saver makes it again


def main() -> int:
    args = parse_args()
    job = Job(args)
    elastic.run(job.train, backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    job.close()
    return 0


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def _tensors(value: Any) -> Iterator[Any]:
    """Every tensor in a nested state dict."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


if __name__ == "__main__":
    raise SystemExit(main())
