"""Record readers: how one file format is counted, indexed and read back.

A reader does two things with an open (seekable) file:
- `scan`: count the file's records once, and note a *seek hint* for every
  `block`-th record (record 0, block, 2*block, ...): a byte offset for JSON
  lines, tar samples and fixed-size records, the row count of each row group
  for Parquet. The catalog caches (count, hints), so a file is scanned once.
- `read_block`: the raw records [first, stop) of the file, `first` a multiple
  of `block`, found with the hint instead of reading the file from its start.
  Decoding is left to `Block.records`, so a rank that needs a few records of a
  block decodes only those.

Invariants: `read_block(first, stop)` returns exactly `stop - first` records,
the records `first..stop-1` that `scan` counted; anything else (a short file, a
bad line) raises `CatalogError` naming the file and the record.
"""

from __future__ import annotations

import abc
import json
import tarfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from dlfleet.api.errors import InvalidArgument

CHUNK = 1 << 20


class CatalogError(InvalidArgument):
    """A file of a catalog is missing, unreadable, or not what was counted."""


@dataclass(frozen=True)
class Scan:
    count: int
    hints: tuple[int, ...]


class Block(abc.ABC):
    """Raw records of one block, decoded on demand."""

    @abc.abstractmethod
    def records(self, offsets: Sequence[int]) -> list[Any]:
        """The decoded records at `offsets` (relative to the block's first)."""


class RecordReader(abc.ABC):
    """A file format. `key` names the reader and its options: two catalogs'
    cached counts are shared only between readers with the same key."""

    key: str

    @abc.abstractmethod
    def scan(self, f: IO[bytes], url: str, block: int) -> Scan: ...

    @abc.abstractmethod
    def read_block(
        self, f: IO[bytes], url: str, hints: Sequence[int], block: int, first: int, stop: int
    ) -> Block: ...


class _ListBlock(Block):
    def __init__(self, items: Sequence[Any], decode: Callable[[Any], Any] | None = None) -> None:
        self._items = items
        self._decode = decode

    def records(self, offsets: Sequence[int]) -> list[Any]:
        if self._decode is None:
            return [self._items[i] for i in offsets]
        return [self._decode(self._items[i]) for i in offsets]


# ------------------------------------------------------------------ JSON lines


class JsonLines(RecordReader):
    """One JSON value per line (a last line without a newline counts)."""

    key = "jsonl"

    def scan(self, f: IO[bytes], url: str, block: int) -> Scan:
        count = 0
        hints: list[int] = []
        offset = 0
        line_start = True  # the next byte starts a line
        while chunk := f.read(CHUNK):
            at = 0
            while at < len(chunk):
                if line_start and count % block == 0:
                    hints.append(offset + at)
                newline = chunk.find(b"\n", at)
                if newline < 0:
                    line_start = False
                    break
                count += 1
                at = newline + 1
                line_start = True
            offset += len(chunk)
        if not line_start:
            count += 1  # a last line without a newline
        return Scan(count, tuple(hints))

    def read_block(
        self, f: IO[bytes], url: str, hints: Sequence[int], block: int, first: int, stop: int
    ) -> Block:
        number = first // block
        f.seek(hints[number])
        # One read of the whole block: the next block's hint is where it ends.
        data = f.read(hints[number + 1] - hints[number]) if number + 1 < len(hints) else f.read()
        lines = _JsonBlock(data, url, first)
        if len(lines) != stop - first:
            raise CatalogError(
                f"{url}: ends at line {first + len(lines)}, but {stop} lines were counted; "
                "the file changed since the catalog counted it"
            )
        return lines


class _JsonBlock(Block):
    """A block of JSON lines, decoded from UTF-8 once for the whole block:
    `json.loads` of bytes detects the encoding and decodes every line (in
    Python, a fifth of parsing a short record). A block that is not UTF-8 is
    kept as bytes, and a line the text fails on (a byte order mark) is parsed
    again from its bytes, as `json.loads` would; only then is it not JSON."""

    def __init__(self, data: bytes, url: str, first: int) -> None:
        self._url = url
        self._first = first
        lines: list[str] | list[bytes]
        try:
            # A newline byte is only ever a newline in UTF-8: the same lines.
            lines = data.decode("utf-8").split("\n")
        except UnicodeDecodeError:
            lines = data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()  # after the last newline
        self._lines = lines

    def __len__(self) -> int:
        return len(self._lines)

    def records(self, offsets: Sequence[int]) -> list[Any]:
        lines, loads = self._lines, json.loads
        try:
            return [loads(lines[i]) for i in offsets]
        except ValueError:
            return [self._from_bytes(i) for i in offsets]  # which line, and why

    def _from_bytes(self, offset: int) -> Any:
        line = self._lines[offset]
        try:
            return json.loads(line.encode() if isinstance(line, str) else line)
        except ValueError as error:
            raise CatalogError(
                f"{self._url}: record {self._first + offset} is not JSON: {error}"
            ) from None


# ------------------------------------------------------------------- Parquet


class ParquetRows(RecordReader):
    """One record per row, as a dict of column values; read a row group at a time."""

    def __init__(self, columns: Sequence[str] | None = None) -> None:
        self.columns = list(columns) if columns is not None else None
        self.key = "parquet" + (":" + ",".join(self.columns) if self.columns else "")

    def scan(self, f: IO[bytes], url: str, block: int) -> Scan:
        meta = _parquet_file(f, url).metadata
        groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        return Scan(int(meta.num_rows), groups)

    def read_block(
        self, f: IO[bytes], url: str, hints: Sequence[int], block: int, first: int, stop: int
    ) -> Block:
        # The hints are the row groups' sizes: read the groups that hold the block.
        groups: list[int] = []
        start = 0
        skip = 0
        for number, rows in enumerate(hints):
            if start + rows > first and start < stop:
                if not groups:
                    skip = first - start
                groups.append(number)
            start += rows
        table = _parquet_file(f, url).read_row_groups(groups, columns=self.columns)
        table = table.slice(skip, stop - first)
        if table.num_rows != stop - first:
            raise CatalogError(f"{url}: rows [{first}, {stop}) are not all in the file any more")
        return _TableBlock(table)


class _TableBlock(Block):
    def __init__(self, table: Any) -> None:
        self._table = table

    def records(self, offsets: Sequence[int]) -> list[Any]:
        rows: list[Any] = self._table.take(list(offsets)).to_pylist()
        return rows


def _parquet_file(f: IO[bytes], url: str) -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise CatalogError("Parquet files need pyarrow: pip install 'dlfleet[stream]'") from None
    f.seek(0)
    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError, ValueError) as error:
        raise CatalogError(f"{url}: not a readable Parquet file: {error}") from error


# ---------------------------------------------------------------- WebDataset


class WebDatasetSamples(RecordReader):
    """WebDataset tar shards: consecutive members sharing a key (the name up
    to the first dot of its last component) are one sample, a dict
    {"__key__": key, extension: bytes, ...}."""

    key = "webdataset"

    def scan(self, f: IO[bytes], url: str, block: int) -> Scan:
        count = 0
        hints: list[int] = []
        last: str | None = None
        for member in _tar_members(f, url):
            key, _ = _split_name(member.name)
            if key != last:
                if count % block == 0:
                    hints.append(member.offset)
                count += 1
                last = key
        return Scan(count, tuple(hints))

    def read_block(
        self, f: IO[bytes], url: str, hints: Sequence[int], block: int, first: int, stop: int
    ) -> Block:
        f.seek(hints[first // block])
        samples: list[dict[str, Any]] = []
        wanted = stop - first
        with _open_tar(f, url) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = _split_name(member.name)
                if not samples or samples[-1]["__key__"] != key:
                    if len(samples) == wanted:
                        break
                    samples.append({"__key__": key})
                data = tar.extractfile(member)
                samples[-1][ext] = data.read() if data is not None else b""
        if len(samples) != wanted:
            raise CatalogError(
                f"{url}: holds {first + len(samples)} samples from record {first}, "
                f"{stop} were counted; the file changed since the catalog counted it"
            )
        return _ListBlock(samples)


def _split_name(name: str) -> tuple[str, str]:
    directory, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext


def _open_tar(f: IO[bytes], url: str) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=f, mode="r:")  # reads from f's current offset
    except tarfile.TarError as error:
        raise CatalogError(f"{url}: not a readable tar file: {error}") from error


def _tar_members(f: IO[bytes], url: str) -> Iterable[tarfile.TarInfo]:
    f.seek(0)
    with _open_tar(f, url) as tar:
        try:
            while (member := tar.next()) is not None:
                if member.isfile():
                    yield member
        except tarfile.TarError as error:
            raise CatalogError(f"{url}: a broken tar member: {error}") from error


# -------------------------------------------------------- fixed-size records


class FixedRecords(RecordReader):
    """A binary file of fixed-size records, e.g. pre-tokenized text cut into
    sequences: `record_items` values of `dtype` each, read as numpy arrays.
    Bytes after the last whole record are not a record (and are ignored)."""

    def __init__(self, record_items: int, dtype: str = "uint16") -> None:
        if record_items < 1:
            raise InvalidArgument(f"record_items must be at least 1, got {record_items}")
        self.dtype = np.dtype(dtype)
        self.record_items = record_items
        self.record_bytes = record_items * self.dtype.itemsize
        self.key = f"fixed:{record_items}:{self.dtype.str}"

    def scan(self, f: IO[bytes], url: str, block: int) -> Scan:
        size = f.seek(0, 2)
        return Scan(size // self.record_bytes, ())

    def read_block(
        self, f: IO[bytes], url: str, hints: Sequence[int], block: int, first: int, stop: int
    ) -> Block:
        f.seek(first * self.record_bytes)
        data = f.read((stop - first) * self.record_bytes)
        if len(data) != (stop - first) * self.record_bytes:
            raise CatalogError(f"{url}: records [{first}, {stop}) are past the end of the file")
        rows = np.frombuffer(data, dtype=self.dtype).reshape(stop - first, self.record_items)
        return _ListBlock(list(rows), np.copy)


# -------------------------------------------------------------- user functions


class FunctionReader(RecordReader):
    """Any other format: `count(f)` counts a file's records and
    `read(f, first, stop)` returns records [first, stop) of it (it seeks
    itself). `name` keys the cached counts."""

    def __init__(
        self,
        name: str,
        count: Callable[[IO[bytes]], int],
        read: Callable[[IO[bytes], int, int], Iterable[Any]],
    ) -> None:
        self.key = f"function:{name}"
        self._count = count
        self._read = read

    def scan(self, f: IO[bytes], url: str, block: int) -> Scan:
        return Scan(int(self._count(f)), ())

    def read_block(
        self, f: IO[bytes], url: str, hints: Sequence[int], block: int, first: int, stop: int
    ) -> Block:
        records = list(self._read(f, first, stop))
        if len(records) != stop - first:
            raise CatalogError(
                f"{url}: the reader {self.key!r} returned {len(records)} records "
                f"for [{first}, {stop})"
            )
        return _ListBlock(records)


BY_SUFFIX: dict[str, Callable[[], RecordReader]] = {
    ".jsonl": JsonLines,
    ".json": JsonLines,
    ".ndjson": JsonLines,
    ".parquet": ParquetRows,
    ".tar": WebDatasetSamples,
}


def reader_for(url: str) -> RecordReader:
    """The built-in reader of a file's suffix (`reader="auto"`)."""
    for suffix, make in BY_SUFFIX.items():
        if url.endswith(suffix):
            return make()
    raise CatalogError(
        f"{url}: no built-in reader for this suffix ({', '.join(BY_SUFFIX)}); pass reader="
    )
