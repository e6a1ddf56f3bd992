"""The training master, one subpackage per process: `service/` is the master
service (`dlmaster` serve mode: the gRPC services the nodes talk to), `job/`
the job supervisor (`dlmaster --job-config`: starts the service and the nodes,
and runs the job to its end). Beside them, `core/` (pure state machines) and
`store/` (the durable journal) serve the service; `__main__` is `dlmaster`,
which dispatches to either. Importing it never imports torch."""
