"""Durable state of the master: an append-only journal of core events plus
per-stream checkpoints, behind `StateStore`; `GroupCommitter` batches appends
so that durability does not cap throughput."""
