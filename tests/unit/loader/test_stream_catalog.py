"""FileCatalog over real files of every built-in format (and a real HTTP
server on 127.0.0.1 for a remote protocol): the records of a leased range are
exactly the records of the files it names; bad input fails with a clear error."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stream_files import FORMATS, http_server, record_id, write, write_catalog

from dlfleet.api.errors import InvalidArgument
from dlfleet.worker.loader.files import (
    CatalogError,
    FileCatalog,
    FixedRecords,
    FunctionReader,
    JsonLines,
    RecordReader,
    WebDatasetSamples,
    write_jsonl_shards,
)
from dlfleet.worker.loader.files.readers import Scan


def catalog(paths: list[Path], cache: Path, **options: Any) -> FileCatalog:
    reader: RecordReader | str = FixedRecords(2, "int64") if paths[0].suffix == ".bin" else "auto"
    return FileCatalog([str(p) for p in paths], reader, cache_dir=cache, **options)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_every_record_in_file_order(tmp_path: Path, fmt: str) -> None:
    paths, ids = write_catalog(tmp_path, [9, 0, 14, 1], [fmt])
    cat = catalog(paths, tmp_path / "cache", block_size=4)
    assert len(cat) == len(ids) == 24
    assert [record_id(r) for r in cat.__getitems__(list(range(24)))] == ids
    assert [record_id(cat[i]) for i in (23, 0, 9, 8)] == [ids[23], ids[0], ids[9], ids[8]]
    assert cat.locate(9) == (str(paths[2]), 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    counts=st.lists(st.integers(0, 25), min_size=1, max_size=6).filter(lambda c: sum(c) > 0),
    formats=st.lists(st.sampled_from(("jsonl", "parquet", "tar")), min_size=1, max_size=3),
    block=st.integers(1, 8),
    window=st.integers(0, 20),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 3),
    cuts=st.lists(st.integers(0, 200), max_size=10),
)
def test_leased_ranges_of_a_random_catalog_read_each_record_exactly_once(
    counts: list[int],
    formats: list[str],
    block: int,
    window: int,
    seed: int,
    epoch: int,
    cuts: list[int],
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        paths, ids = write_catalog(root, counts, formats)
        cat = catalog(paths, root / "cache", block_size=block, shuffle_window=window)
        order = cat.epoch_order(seed, epoch, shuffle=True)
        size = len(cat)
        edges = sorted({0, size, *(c % (size + 1) for c in cuts)})
        read: list[int] = []
        for a, b in itertools.pairwise(edges):  # a lease each
            read += [record_id(r) for r in cat.__getitems__(order.ranges([(a, b)]))]
        assert sorted(read) == ids
        cat.close()


def test_counts_are_cached_and_a_second_catalog_reads_no_file_to_count(tmp_path: Path) -> None:
    paths, _ = write_catalog(tmp_path, [5, 6], ["jsonl"])
    scans: list[str] = []

    class Counting(JsonLines):
        def scan(self, f: IO[bytes], url: str, block: int) -> Scan:
            scans.append(url)
            return super().scan(f, url, block)

    first = FileCatalog([str(p) for p in paths], Counting(), cache_dir=tmp_path / "c")
    second = FileCatalog([str(p) for p in paths], Counting(), cache_dir=tmp_path / "c")
    assert len(scans) == 2 and len(first) == len(second) == 11
    assert len(list((tmp_path / "c").glob("*.json"))) == 2


def test_globs_expand_sorted_and_the_catalog_pickles_without_open_files(tmp_path: Path) -> None:
    paths, ids = write_catalog(tmp_path, [3, 4, 5], ["jsonl"])
    cat = FileCatalog(
        str(tmp_path / "part-*.jsonl"), cache_dir=tmp_path / "c", block_size=2, prefetch_blocks=1
    )
    assert [f.url for f in cat.files] == [str(p) for p in paths]
    cat.epoch_order(0, 0, True)
    assert record_id(cat[0]) == ids[0]  # opens a file, starts the prefetch thread
    copy = pickle.loads(pickle.dumps(cat))
    assert [record_id(r) for r in copy.__getitems__(list(range(12)))] == ids
    cat.close()


def test_a_user_function_reads_any_format(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha\nbeta\ngamma\n")

    def count(f: IO[bytes]) -> int:
        return len(f.read().splitlines())

    def read(f: IO[bytes], first: int, stop: int) -> list[str]:
        f.seek(0)
        return [line.decode() for line in f.read().splitlines()[first:stop]]

    cat = FileCatalog(
        str(tmp_path / "a.txt"), FunctionReader("lines", count, read), cache_dir=tmp_path / "c"
    )
    assert cat.__getitems__([2, 0]) == ["gamma", "alpha"]


def test_files_served_over_http_are_read_with_range_requests(tmp_path: Path) -> None:
    paths, ids = write_catalog(tmp_path, [11, 7, 9], ["jsonl", "parquet", "tar"])
    with http_server(tmp_path) as base:
        urls = [f"{base}/{p.name}" for p in paths]
        cat = FileCatalog(urls, cache_dir=tmp_path / "c", block_size=4)
        globbed = FileCatalog(f"{base}/part-*", cache_dir=tmp_path / "c", block_size=4)
        assert [f.url for f in globbed.files] == urls  # from the server's folder listing
        order = cat.epoch_order(5, 1, shuffle=True)
        read = [record_id(r) for r in cat.__getitems__(order.ranges([(0, 27)]))]
        assert sorted(read) == ids
        cat.close()


# ------------------------------------------------------------- bad input


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=r"nope\.jsonl: no such file"):
        FileCatalog(str(tmp_path / "nope.jsonl"), cache_dir=tmp_path / "c")


def test_a_glob_that_matches_nothing_is_named(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="matches no file"):
        FileCatalog(str(tmp_path / "*.jsonl"), cache_dir=tmp_path / "c")


def test_an_unknown_suffix_asks_for_a_reader(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("1\n")
    with pytest.raises(CatalogError, match=r"a\.csv: no built-in reader"):
        FileCatalog(str(tmp_path / "a.csv"), cache_dir=tmp_path / "c")


def test_unreadable_formats_are_named(tmp_path: Path) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(CatalogError, match=r"bad\.parquet: not a readable Parquet file"):
        FileCatalog(str(tmp_path / "bad.parquet"), cache_dir=tmp_path / "c")
    (tmp_path / "bad.tar").write_bytes(b"\x01" * 1024)
    with pytest.raises(CatalogError, match=r"bad\.tar"):
        FileCatalog(str(tmp_path / "bad.tar"), WebDatasetSamples(), cache_dir=tmp_path / "c")
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\nnot json\n')
    cat = FileCatalog(str(tmp_path / "bad.jsonl"), cache_dir=tmp_path / "c")
    assert cat[0] == {"id": 1}
    with pytest.raises(CatalogError, match=r"bad\.jsonl: record 1 is not JSON"):
        cat.__getitems__([1])


def test_json_lines_parse_as_json_loads_parses_each_line_bytes(tmp_path: Path) -> None:
    # Blocks are decoded from UTF-8 once, not line by line; what a line
    # means, and which lines are errors, is still json.loads(line_bytes)'s.
    lines = [
        b'\xef\xbb\xbf{"id": 0}',  # a byte order mark, as a file's first bytes
        '{"id": 1, "text": "na\u00efve \u65e5\u672c"}'.encode(),
        b'{"id": 2, "text": "\xff"}',  # not UTF-8
        b'{"id": 3}',
    ]
    (tmp_path / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    cat = FileCatalog(str(tmp_path / "mixed.jsonl"), cache_dir=tmp_path / "c", block_size=2)
    assert cat.__getitems__([1, 0]) == [json.loads(lines[1]), json.loads(lines[0])]
    assert cat[3] == {"id": 3}
    with pytest.raises(CatalogError, match=r"mixed\.jsonl: record 2 is not JSON"):
        cat[2]


def test_a_file_whose_record_count_changed_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", "jsonl", range(10))
    cat = FileCatalog(str(path), cache_dir=tmp_path / "c")
    write(path, "jsonl", range(12))  # appended to after it was counted
    with pytest.raises(CatalogError, match=r"a\.jsonl: the file changed since the catalog"):
        cat[0]
    copy = FileCatalog(str(path), cache_dir=tmp_path / "c")  # a new version: counted again
    assert len(copy) == 12


def test_a_file_rewritten_with_the_same_size_is_refused_not_misread(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", "jsonl", range(10))
    cat = FileCatalog(str(path), cache_dir=tmp_path / "c", block_size=4)
    text = path.read_text()
    path.write_text(text.replace("\n", " ", 3))  # same bytes, 3 lines fewer
    os.utime(path, ns=(1, 1))
    with pytest.raises(CatalogError, match=r"a\.jsonl: the file changed since the catalog"):
        cat.__getitems__([9])


def test_a_reader_finding_fewer_records_than_counted_says_so(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", "jsonl", range(10))
    with path.open("rb") as f:
        scan = JsonLines().scan(f, "a.jsonl", 4)
    assert scan.count == 10 and len(scan.hints) == 3
    path.write_text(path.read_text()[::-1].replace("\n", " ", 4)[::-1])  # 7 lines left
    with path.open("rb") as f, pytest.raises(CatalogError, match="ends at line 7, but 10"):
        JsonLines().read_block(f, "a.jsonl", scan.hints, 4, 4, 10)


def test_an_empty_catalog_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("")
    with pytest.raises(CatalogError, match="hold no records"):
        FileCatalog(str(tmp_path / "a.jsonl"), cache_dir=tmp_path / "c")


def test_any_iterable_is_cut_into_files_that_a_catalog_reads(tmp_path: Path) -> None:
    stream = ({"id": i, "text": f"record {i}"} for i in range(23))  # e.g. an HF stream
    paths = write_jsonl_shards(stream, tmp_path / "shards", 10)
    assert [Path(p).name for p in paths] == [
        "part-00000.jsonl",
        "part-00001.jsonl",
        "part-00002.jsonl",
    ]
    cat = FileCatalog(str(tmp_path / "shards" / "*.jsonl"), cache_dir=tmp_path / "c")
    assert [f.count for f in cat.files] == [10, 10, 3]
    assert [r["id"] for r in cat.__getitems__(list(range(23)))] == list(range(23))
    with pytest.raises(InvalidArgument, match="record 2 is not JSON-serializable"):
        write_jsonl_shards([1, 2, object()], tmp_path / "bad", 10)


def test_the_fingerprint_changes_with_the_files_and_the_block_order(tmp_path: Path) -> None:
    paths, _ = write_catalog(tmp_path, [5, 6], ["jsonl"])
    files = [str(p) for p in paths]
    same = {FileCatalog(files, cache_dir=tmp_path / "c").fingerprint for _ in range(2)}
    assert len(same) == 1
    others = {
        FileCatalog(files, cache_dir=tmp_path / "c", block_size=3).fingerprint,
        FileCatalog(files, cache_dir=tmp_path / "c", shuffle_window=7).fingerprint,
        FileCatalog(files[:1], cache_dir=tmp_path / "c").fingerprint,
    }
    assert len(others) == 3 and not others & same


@pytest.mark.filterwarnings("ignore:ShardedDataLoader")
def test_forked_dataloader_workers_do_not_inherit_a_held_lock_or_open_files(
    tmp_path: Path,
) -> None:
    """The read-ahead thread may hold the catalog's lock when a DataLoader
    forks its workers: a worker that kept the inherited lock would wait for
    ever (here: the DataLoader's 20 s timeout fails the test)."""
    from dlfleet.worker.loader import LoaderEnvironment, ShardedDataLoader

    paths, ids = write_catalog(tmp_path, [40, 40], ["jsonl"])
    cat = FileCatalog([str(p) for p in paths], cache_dir=tmp_path / "c", block_size=4)
    assert record_id(cat[0]) == ids[0]  # the parent holds a file open
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # as the read-ahead thread does while it reads a block
        with cat._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        loader = ShardedDataLoader(
            cat, 4, num_workers=2, multiprocessing_context="fork", collate_fn=lambda b: b,
            timeout=20, environment=LoaderEnvironment(master=None),
        )  # fmt: skip
        assert sorted(record_id(r) for b in loader for r in b) == ids
    finally:
        release.set()
        holder.join(10)
    cat.close()


def test_the_next_block_of_the_epoch_is_read_ahead_in_the_background(tmp_path: Path) -> None:
    paths, ids = write_catalog(tmp_path, [12, 12], ["jsonl", "tar"])
    cat = FileCatalog([str(p) for p in paths], cache_dir=tmp_path / "c", block_size=4)
    assert cat.prefetch_blocks == 0  # local files: the page cache is ahead already
    cat = FileCatalog(
        [str(p) for p in paths], cache_dir=tmp_path / "c", block_size=4, prefetch_blocks=1
    )
    order = cat.epoch_order(3, 0, shuffle=True)
    visited = order.ranges([(0, 24)])
    cat.__getitems__([visited[0]])
    after = order.following(visited[0], 1)[0]
    file, local = cat.locate(after)
    key = ([f.url for f in cat.files].index(file), local // 4)
    deadline = time.monotonic() + 10
    while key not in cat._blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert key in cat._blocks  # read by the background thread, not asked for yet
    assert record_id(cat[after]) == ids[after]
    cat.close()
