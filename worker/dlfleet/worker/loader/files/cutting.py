"""Cutting any iterable of records into JSON-lines files, so that a stream
without files of its own (a generator, a Hugging Face `datasets` streaming
source that is not backed by files you can reach) becomes a `FileCatalog`.

Run it once, before training (a preparation step, or rank 0 followed by a
barrier): the files are written to temporary names and renamed when complete,
so a catalog never counts a half-written file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dlfleet.api.errors import InvalidArgument


def write_jsonl_shards(
    records: Iterable[Any],
    directory: str | os.PathLike[str],
    records_per_file: int,
    *,
    prefix: str = "part",
    encode: Callable[[Any], Any] | None = None,
) -> list[str]:
    """Write `records` as JSON lines, `records_per_file` a file
    (`<prefix>-00000.jsonl`, ...); returns the paths, in order. `encode` turns
    a record into something `json.dumps` takes (default: the record itself)."""
    if records_per_file < 1:
        raise InvalidArgument(f"records_per_file must be at least 1, got {records_per_file}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    lines: list[str] = []

    def flush() -> None:
        path = root / f"{prefix}-{len(paths):05d}.jsonl"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(lines), encoding="utf-8")
        os.replace(tmp, path)
        paths.append(str(path))
        lines.clear()

    for record in records:
        try:
            lines.append(json.dumps(encode(record) if encode else record) + "\n")
        except (TypeError, ValueError) as error:
            raise InvalidArgument(
                f"record {len(paths) * records_per_file + len(lines)} is not JSON-serializable "
                f"({error}); pass encode="
            ) from None
        if len(lines) == records_per_file:
            flush()
    if lines:
        flush()
    return paths
