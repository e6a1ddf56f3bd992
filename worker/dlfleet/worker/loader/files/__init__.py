"""File catalogs: sharded files (JSON lines, Parquet, WebDataset tars, binary
token files, any format with a `FunctionReader`) as one indexed dataset that
`ShardedDataLoader` leases exactly once (see catalog.py)."""

from dlfleet.worker.loader.files.catalog import CatalogFile, FileCatalog
from dlfleet.worker.loader.files.cutting import write_jsonl_shards
from dlfleet.worker.loader.files.readers import (
    CatalogError,
    FixedRecords,
    FunctionReader,
    JsonLines,
    ParquetRows,
    RecordReader,
    WebDatasetSamples,
)

__all__ = [
    "CatalogError",
    "CatalogFile",
    "FileCatalog",
    "FixedRecords",
    "FunctionReader",
    "JsonLines",
    "ParquetRows",
    "RecordReader",
    "WebDatasetSamples",
    "write_jsonl_shards",
]
