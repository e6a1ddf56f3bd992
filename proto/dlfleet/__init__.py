"""dlfleet: an elastic, fault-tolerant control plane for data-parallel PyTorch.

`dlfleet` is one import namespace spread over the component folders (`proto/`,
`master/`, `worker/`, `brain/`). This file is the one deliberate piece that
joins them: it extends `__path__` pkgutil-style, so a source checkout with the
component folders on `sys.path` works like an installed wheel, and it
re-exports the user-facing names lazily, so `import dlfleet.master` never
imports torch.
"""

from __future__ import annotations

import importlib
from pkgutil import extend_path
from typing import Any

__path__ = extend_path(__path__, __name__)

# name -> module that defines it; imported on first access only.
_LAZY_EXPORTS = {
    "ShardedDataLoader": "dlfleet.worker.loader",
    "Checkpointer": "dlfleet.worker.checkpoint.checkpointer",
    "FileCatalog": "dlfleet.worker.loader.files",
    "JsonLines": "dlfleet.worker.loader.files",
    "ParquetRows": "dlfleet.worker.loader.files",
    "WebDatasetSamples": "dlfleet.worker.loader.files",
    "FixedRecords": "dlfleet.worker.loader.files",
    "FunctionReader": "dlfleet.worker.loader.files",
    "write_jsonl_shards": "dlfleet.worker.loader.files",
    "zero_weight": "dlfleet.worker.loader.padding",
}
# name -> module that *is* it (`from dlfleet import elastic`).
_LAZY_MODULES = {
    "elastic": "dlfleet.worker.elastic",
}

__all__ = [
    "Checkpointer",
    "FileCatalog",
    "FixedRecords",
    "FunctionReader",
    "JsonLines",
    "ParquetRows",
    "ShardedDataLoader",
    "WebDatasetSamples",
    "elastic",
    "write_jsonl_shards",
    "zero_weight",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dlfleet' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
