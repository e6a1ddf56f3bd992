"""The brain: job metrics in a database and resource plans for the master.

Public surface (the master imports only these):
- `dlfleet.brain.api`: `BrainApi`, `open_brain` (in-process or a `dlbrain` service);
- `dlfleet.brain.records`: the values that cross it (`JobInfo`, `RoundMetrics`,
  `NodeSample`, `FailureRecord`, `MetricsBatch`, `PlanRequest`, `Plan`, ...);
- `dlfleet.brain.reporter`: `BrainReporter`, metrics sent without blocking.

Underneath: `optimizer` (pure decisions), `repository`/`models`/`schema`
(SQLAlchemy and Alembic), `server`/`client`/`wire` (gRPC), `cli` (`dlbrain`).
Nothing here imports the master, the worker or torch; importing this package
imports nothing else.
"""
