"""The master service: the gRPC server the job's nodes talk to (rendezvous,
shards, liveness, checkpoints, status) over the cores and the durable store.

Everything here runs in the master service process, `dlmaster` in serve mode
(`python -m dlfleet.master --port ...`), which the job supervisor starts as a
child. It never imports the supervisor (`dlfleet.master.job`): an
import-linter contract in pyproject.toml keeps it so."""
