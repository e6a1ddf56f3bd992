"""`FileCatalog`: many files (local paths or fsspec URLs, globs allowed) read
as one indexed dataset, so that the master's leases cover streamed data too.

Why: the master leases positions of an epoch, and everything that makes the
loader exactly-once (leases to the round, fencing, requeue of remainders,
snapshots as ranges) works on positions. A catalog numbers the records of its
files one after the other (file 0's records, then file 1's, ...: the prefix
sums of the per-file counts), so a leased range is a set of (file, first
record, last record) pieces; `BlockOrder` (order.py) keeps each epoch's reads
sequential within blocks of files. The master sees a dataset of `len(catalog)`
records; its memory grows with shards, never with records or files.

Counting: each file's records are counted once (files in parallel threads)
and the count, with the reader's seek hints, is cached as a small JSON file
per file version in `cache_dir` (default: the job's work directory,
DLFLEET_WORKDIR/catalogs, else ~/.cache/dlfleet/catalogs). A file's version is its
size and modification time (or ETag) as its file system reports them.

Invariants:
- Every rank that builds the same catalog gets the same numbering: files are
  taken in the order given, each glob's matches sorted.
- A file whose size changed since it was counted is refused when opened
  (`CatalogError` naming it), and a reader that finds fewer records than
  counted raises: a changed file never silently shifts the numbering.
- A process reads only the blocks holding the records it is asked for,
  through a bounded cache of blocks and open files; a background thread
  reads the next block of the epoch's order ahead (`prefetch_blocks`; by
  default one block for remote files and none for local ones, which the page
  cache serves at once: there the thread would only take the GIL).
- The catalog pickles without its open files, caches or thread, so
  DataLoader workers (`num_workers`) each read the batches given to them; a
  worker forked with the catalog in memory drops what it inherited (open
  files share their offsets across a fork) before its first read.
- The background read-ahead follows the epoch order the loader asked for in
  this process: in the training process (num_workers=0). DataLoader workers
  read ahead by whole batches instead (prefetch_factor).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from torch.utils.data import Dataset

from dlfleet.api.env import CATALOG_CACHE_ENV, WORKDIR_ENV
from dlfleet.api.errors import InvalidArgument
from dlfleet.worker.loader.files.order import BlockOrder
from dlfleet.worker.loader.files.readers import Block, CatalogError, RecordReader, reader_for

DEFAULT_BLOCK = 1024
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class CatalogFile:
    """One counted file."""

    url: str
    size: int  # bytes
    version: str  # modification time or ETag, as its file system reports it
    count: int  # records
    hints: tuple[int, ...]  # the reader's seek hints (see readers.py)
    reader: RecordReader


class FileCatalog(Dataset[Any]):
    """The records of `files`, read with `reader` ("auto": by suffix, or a
    `RecordReader` for all files), as one map-style dataset for
    `ShardedDataLoader`.

    `block_size`: records per block (the unit of sequential reads and of the
    per-epoch file/block shuffle). `shuffle_window`: positions shuffled
    together within a block-shuffled epoch (default 4 blocks; 0 or 1: none).
    `transform`: applied to each decoded record. `prefetch_blocks`: blocks
    read ahead in the background (default: 1 for remote files, 0 for local)."""

    # Per process, rebuilt after unpickling (see _reset).
    _lock: threading.RLock
    _handles: OrderedDict[int, IO[bytes]]
    _blocks: OrderedDict[tuple[int, int], Block]
    _keep_blocks: int
    _prefetcher: concurrent.futures.ThreadPoolExecutor | None
    _pending: set[tuple[int, int]]
    _order: BlockOrder | None
    _prefetched_after: int | None  # the catalog block the last read-ahead followed
    _pid: int

    def __init__(
        self,
        files: str | Sequence[str],
        reader: RecordReader | str = "auto",
        *,
        block_size: int = DEFAULT_BLOCK,
        shuffle_window: int | None = None,
        transform: Callable[[Any], Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        scan_threads: int = 8,
        prefetch_blocks: int | None = None,
        max_open_files: int = 16,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if block_size < 1:
            raise InvalidArgument(f"block_size must be at least 1, got {block_size}")
        if shuffle_window is not None and shuffle_window < 0:
            raise InvalidArgument(f"shuffle_window must be 0 or more, got {shuffle_window}")
        if reader != "auto" and not isinstance(reader, RecordReader):
            raise InvalidArgument(f"reader must be 'auto' or a RecordReader, got {reader!r}")
        self.block_size = block_size
        self.shuffle_window = 4 * block_size if shuffle_window is None else shuffle_window
        self.transform = transform
        self.max_open_files = max(1, max_open_files)
        self.storage_options = dict(storage_options or {})
        self.cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
        urls = _expand(files if not isinstance(files, str) else [files], self.storage_options)
        self.files: tuple[CatalogFile, ...] = _count_all(
            urls, reader, block_size, self.cache_dir, scan_threads, self.storage_options
        )
        remote = any("://" in f.url and not f.url.startswith("file://") for f in self.files)
        default = 1 if remote else 0
        self.prefetch_blocks = default if prefetch_blocks is None else prefetch_blocks
        counts = np.array([f.count for f in self.files], dtype=np.int64)
        self.size = int(counts.sum())
        if self.size == 0:
            raise CatalogError(f"the catalog's {len(self.files)} files hold no records")
        self._bases = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        # Blocks of each file: records [k * block_size, (k + 1) * block_size).
        per_file = -(-counts // block_size)
        file_of = np.repeat(np.arange(len(counts), dtype=np.int64), per_file)
        first_block = np.repeat(np.cumsum(per_file) - per_file, per_file)
        within = (np.arange(len(file_of), dtype=np.int64) - first_block) * block_size
        self._block_starts = (self._bases[file_of] + within).astype(np.int64)
        self._block_lengths = np.minimum(block_size, counts[file_of] - within).astype(np.int64)
        # Catalog block -> (file, block number within the file): the cache's key.
        self._block_files = file_of
        self._block_numbers = (within // block_size).astype(np.int64)
        self._reset()

    # ---------------------------------------------------------------- dataset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The records at `indices` (global record numbers), in order; the
        DataLoader calls this once per batch."""
        if not indices:
            return []
        if self._pid != os.getpid():
            # A forked DataLoader worker: its parent's open files share their
            # offsets with it, and a lock may have been held at the fork.
            self._reset()
        if min(indices) < 0 or max(indices) >= self.size:
            raise IndexError(f"record indices outside [0, {self.size})")
        # Which catalog block holds each record, and where in it; then one
        # read of each block, in the order the batch first needs them.
        wanted = np.asarray(indices, dtype=np.int64)
        blocks = np.searchsorted(self._block_starts, wanted, side="right") - 1
        offsets = (wanted - self._block_starts[blocks]).tolist()
        groups: dict[int, list[int]] = {}
        for at, number in enumerate(blocks.tolist()):
            group = groups.get(number)
            if group is None:
                groups[number] = [at]
            else:
                group.append(at)
        out: list[Any] = [None] * len(indices)
        for number, ats in groups.items():
            block = self._block(int(self._block_files[number]), int(self._block_numbers[number]))
            records = block.records([offsets[at] for at in ats])
            for at, record in zip(ats, records, strict=True):
                out[at] = record
        if self.transform is not None:
            transform = self.transform
            out = [transform(record) for record in out]
        last = int(blocks[-1])
        if last != self._prefetched_after:  # once per block reached
            self._prefetched_after = last
            self._prefetch_after(int(wanted[-1]))
        return out

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> BlockOrder:
        """Position -> record of one epoch (the loader asks for it)."""
        order = BlockOrder(
            self._block_starts, self._block_lengths, seed, epoch, shuffle, self.shuffle_window
        )
        self._order = order
        return order

    @property
    def fingerprint(self) -> str:
        """A digest of what decides the numbering and the order: the files,
        their versions and counts, the block size and the shuffle window. The
        loader names the dataset after it (unless given name=), so progress
        recorded for one catalog is never applied to a different one."""
        parts = [(f.url, f.size, f.version, f.count, f.reader.key) for f in self.files]
        text = json.dumps([parts, self.block_size, self.shuffle_window])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def locate(self, index: int) -> tuple[str, int]:
        """(file URL, record number within the file) of global record `index`."""
        f = int(np.searchsorted(self._bases, index, side="right")) - 1
        return self.files[f].url, index - int(self._bases[f])

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None

    # --------------------------------------------------------------- internals

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._handles = OrderedDict()
        self._blocks = OrderedDict()
        self._keep_blocks = max(4, self.shuffle_window // self.block_size + 3)
        self._prefetcher = None
        self._pending = set()
        self._order = None
        self._prefetched_after = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in (
            "_pid", "_lock", "_handles", "_blocks", "_prefetcher", "_pending", "_order",
            "_prefetched_after",
        ):  # fmt: skip
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def _block(self, f: int, number: int) -> Block:
        key = (f, number)
        with self._lock:
            cached = self._blocks.get(key)
            if cached is not None:
                self._blocks.move_to_end(key)
                return cached
            entry = self.files[f]
            first = number * self.block_size
            stop = min(first + self.block_size, entry.count)
            block = entry.reader.read_block(
                self._handle(f), entry.url, entry.hints, self.block_size, first, stop
            )
            self._blocks[key] = block
            while len(self._blocks) > self._keep_blocks:
                self._blocks.popitem(last=False)
            return block

    def _handle(self, f: int) -> IO[bytes]:
        held = self._handles.get(f)
        if held is not None:
            self._handles.move_to_end(f)
            return held
        entry = self.files[f]
        fs, path = _filesystem(entry.url, self.storage_options)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise CatalogError(
                f"{entry.url}: the file is gone since the catalog counted it"
            ) from None
        size, version = _identity(info)
        if (size, version) != (entry.size, entry.version):
            raise CatalogError(
                f"{entry.url}: the file changed since the catalog counted it "
                f"({entry.size} bytes, version {entry.version!r} then; {size} bytes, "
                f"version {version!r} now); build the catalog again"
            )
        handle: IO[bytes] = fs.open(path, "rb")
        self._handles[f] = handle
        while len(self._handles) > self.max_open_files:
            self._handles.popitem(last=False)[1].close()
        return handle

    def _prefetch_after(self, record: int) -> None:
        """Read the next blocks of this epoch's order in the background, so
        the first records of the next lease are in memory when asked for."""
        order = self._order
        if order is None or self.prefetch_blocks < 1:
            return
        for start in order.following(record, self.prefetch_blocks):
            f = int(np.searchsorted(self._bases, start, side="right")) - 1
            key = (f, (start - int(self._bases[f])) // self.block_size)
            with self._lock:
                if key in self._blocks or key in self._pending:
                    continue
                self._pending.add(key)
                if self._prefetcher is None:
                    self._prefetcher = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="dlfleet-prefetch"
                    )
                prefetcher = self._prefetcher
            prefetcher.submit(self._prefetch, key)

    def _prefetch(self, key: tuple[int, int]) -> None:
        try:
            self._block(*key)
        except (CatalogError, OSError):
            pass  # the training thread reads the block itself and raises the error
        finally:
            with self._lock:
                self._pending.discard(key)


# ------------------------------------------------------------------ building


def _default_cache_dir() -> Path:
    if os.environ.get(CATALOG_CACHE_ENV):
        return Path(os.environ[CATALOG_CACHE_ENV])
    if os.environ.get(WORKDIR_ENV):
        return Path(os.environ[WORKDIR_ENV]) / "catalogs"
    return Path.home() / ".cache" / "dlfleet" / "catalogs"


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise CatalogError("file catalogs need fsspec: pip install 'dlfleet[stream]'") from None
    try:
        fs, path = url_to_fs(url, **options)
    except (ImportError, ValueError) as error:
        raise CatalogError(f"{url}: no file system for this URL: {error}") from error
    return fs, str(path)


def _expand(patterns: Sequence[str], options: dict[str, Any]) -> list[str]:
    urls: list[str] = []
    for pattern in patterns:
        if not any(c in pattern for c in _GLOB_CHARS):
            urls.append(pattern)
            continue
        fs, path = _filesystem(pattern, options)
        matches = sorted(fs.glob(path))
        if not matches:
            raise CatalogError(f"{pattern}: matches no file")
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        urls.extend(m if local else fs.unstrip_protocol(m) for m in matches)
    if not urls:
        raise CatalogError("a catalog needs at least one file")
    return urls


def _count_all(
    urls: list[str],
    reader: RecordReader | str,
    block: int,
    cache_dir: Path,
    threads: int,
    options: dict[str, Any],
) -> tuple[CatalogFile, ...]:
    readers = [reader_for(u) if reader == "auto" else reader for u in urls]
    assert all(isinstance(r, RecordReader) for r in readers)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(urls)))) as pool:
        futures = [
            pool.submit(_count, url, r, block, cache_dir, options)
            for url, r in zip(urls, readers, strict=True)
            if isinstance(r, RecordReader)
        ]
        return tuple(f.result() for f in futures)


def _identity(info: dict[str, Any]) -> tuple[int, str]:
    """(size, version) of a file as its file system describes it."""
    version = info.get("mtime") or info.get("ETag") or info.get("LastModified") or ""
    return int(info.get("size") or 0), str(version)


def _count(
    url: str, reader: RecordReader, block: int, cache_dir: Path, options: dict[str, Any]
) -> CatalogFile:
    fs, path = _filesystem(url, options)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise CatalogError(f"{url}: no such file") from None
    size, version = _identity(info)
    key = json.dumps([url, size, version, reader.key, block])
    cached = cache_dir / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    try:
        data = json.loads(cached.read_text())
        return CatalogFile(url, size, version, int(data["count"]), tuple(data["hints"]), reader)
    except (OSError, ValueError, KeyError):
        pass  # not counted yet (or a torn cache file): count it
    with fs.open(path, "rb") as f:
        scan = reader.scan(f, url, block)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps({"key": key, "count": scan.count, "hints": list(scan.hints)}))
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only cache: count again next time
    return CatalogFile(url, size, version, scan.count, scan.hints, reader)
