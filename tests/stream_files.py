"""Real files of each built-in catalog format for the stream tests: every
record carries its id, so a test can say which record it was given, and an
HTTP server with Range support on 127.0.0.1 to serve them (a real remote
protocol for fsspec's http file system)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

FORMATS = ("jsonl", "parquet", "tar", "bin")
BIN_ITEMS = 2  # a .bin record: [id, 3 * id] as int64


def write(path: Path, fmt: str, ids: Sequence[int], row_group: int = 5) -> Path:
    """A file of format `fmt` holding the records `ids`, in order."""
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"id": i, "x": i / 7}) + "\n" for i in ids))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"id": list(ids), "x": [i / 7 for i in ids]})
        pq.write_table(table, path, row_group_size=max(1, row_group))
    elif fmt == "tar":
        with tarfile.open(path, "w") as tar:
            for i in ids:
                for ext, data in (("json", json.dumps({"id": i}).encode()), ("cls", b"%d" % i)):
                    info = tarfile.TarInfo(f"s{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    elif fmt == "bin":
        rows = np.array([[i, 3 * i] for i in ids], dtype=np.int64).reshape(-1, BIN_ITEMS)
        path.write_bytes(rows.tobytes())
    else:
        raise ValueError(fmt)
    return path


def record_id(record: Any) -> int:
    """The id a record of any of the formats carries."""
    if isinstance(record, np.ndarray):
        assert int(record[1]) == 3 * int(record[0])
        return int(record[0])
    if "json" in record:
        key = int(json.loads(record["json"])["id"])
        assert record["cls"] == b"%d" % key and record["__key__"] == f"s{key:08d}"
        return key
    return int(record["id"])


def write_catalog(
    root: Path, counts: Sequence[int], formats: Sequence[str], start: int = 0
) -> tuple[list[Path], list[int]]:
    """Files with `counts[k]` records each, of format formats[k % len]; ids
    numbered from `start` in file order. Returns (paths, ids)."""
    paths: list[Path] = []
    ids: list[int] = []
    at = start
    for k, count in enumerate(counts):
        fmt = formats[k % len(formats)]
        chunk = list(range(at, at + count))
        paths.append(write(root / f"part-{k:04d}.{fmt}", fmt, chunk, row_group=3 + k % 4))
        ids += chunk
        at += count
    return paths, ids


class _RangeHandler(SimpleHTTPRequestHandler):
    """http.server's static files, plus single byte ranges (what fsspec asks)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_head(self) -> Any:
        spec = self.headers.get("Range")
        if not spec or not spec.startswith("bytes="):
            return super().send_head()
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return None
        size = path.stat().st_size
        first_text, _, last_text = spec[len("bytes=") :].partition("-")
        if first_text:
            first = int(first_text)
            last = min(int(last_text), size - 1) if last_text else size - 1
        else:  # a suffix: the last N bytes
            first, last = max(0, size - int(last_text)), size - 1
        if first >= size:
            self.send_error(416)
            return None
        with path.open("rb") as f:
            f.seek(first)
            data = f.read(last - first + 1)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(last - first + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return io.BytesIO(data)


@contextmanager
def http_server(root: Path) -> Iterator[str]:
    """Serve `root` on 127.0.0.1 (a free port); yields the base URL."""

    def handler(*args: Any) -> _RangeHandler:
        return _RangeHandler(*args, directory=os.fspath(root))

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
