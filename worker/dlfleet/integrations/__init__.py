"""Adapters that bring dlfleet's loader and checkpoints to the trainers people
use: `dlfleet.integrations.hf` (Hugging Face `Trainer`, Accelerate) and
`dlfleet.integrations.lightning` (PyTorch Lightning).

Each is a thin adapter over `ShardedDataLoader` and `Checkpointer` at the
framework's own extension points; the framework is imported only in its
module (an import-linter contract keeps it out of the rest of dlfleet).
"""
