"""The process contract: every environment variable one dlfleet process (or
the user) sets and another reads, each name written here once.

A line's comment says who sets the variable and who reads it. "The user" is
whoever starts the program: a shell, a job.yaml's `env`, a test. Everything
else imports the name from here, so that renaming a variable is one line.
This module imports nothing: the agent, the workers and the brain all load it.
"""

from __future__ import annotations

# The job's token. Set by the user, the job supervisor for its master and its
# nodes (local: the process environment; Kubernetes: from the job's Secret) and
# by the agent for its workers and its node check; read by dlmaster, dlworker,
# the workers (loader, checkpointer, in-process restarts), the node check and
# the torchrun rendezvous handler.
TOKEN_ENV = "DLFLEET_TOKEN"
# The PEM root certificate(s) of a TLS master. Set by the user or the job
# supervisor (a Kubernetes node: the mounted ca.crt); read by every client.
TLS_CA_ENV = "DLFLEET_TLS_CA"

# The master's HOST:PORT. Set by the user for dlworker and by the agent (or
# the torchrun rendezvous handler) for its workers; read by dlworker, the loader
# and the checkpointer.
MASTER_ENV = "DLFLEET_MASTER"
# The rendezvous round a worker belongs to. Set by the agent (or the torchrun
# rendezvous handler) for its workers; read by the loader, the checkpointer and
# the in-process restart runner.
ROUND_ENV = "DLFLEET_ROUND"
# The node's id at the master. Set by the agent (or the torchrun rendezvous
# handler) for its workers; read by the loader and the checkpointer.
NODE_ID_ENV = "DLFLEET_NODE_ID"
# The agent's Unix socket. Set by the agent for its workers; read by the
# in-process restart runner and the checkpointer.
AGENT_ENV = "DLFLEET_AGENT"
# The node keeper's address (a Unix socket) where no agent runs the workers:
# set by the torchrun rendezvous handler, which keeps the node's checkpoint
# images in torchrun's agent process; read by the checkpointer (AGENT_ENV,
# where set, names the same service and wins).
KEEPER_ENV = "DLFLEET_KEEPER"
# "1" in a spare worker (started ahead of a failure). Set by the agent; read
# by the in-process restart runner.
SPARE_ENV = "DLFLEET_SPARE"
# The job's largest node count (the master's --max-nodes), set by dlworker for
# its workers: the largest world is this times LOCAL_WORLD_SIZE.
MAX_NODES_ENV = "DLFLEET_MAX_NODES"
# The agent keeper's folder for this node's checkpoint images. Set by the
# agent (or the torchrun rendezvous handler) for its workers; read by the
# checkpointer.
CHECKPOINT_DIR_ENV = "DLFLEET_CHECKPOINT_DIR"
# Each rank's progress file. Set by the agent for each worker; read (and the
# file written) by `dlfleet.worker.progress` in the worker.
PROGRESS_ENV = "DLFLEET_PROGRESS_FILE"
# The job's work folder. Set by the local platform for its nodes (or by the
# user); read by the checkpointer (default persist_dir) and the file catalog.
WORKDIR_ENV = "DLFLEET_WORKDIR"

# The address a node publishes: torchrun's variable for its --local-addr. Set
# by the Kubernetes platform from the Pod IP (or by the user); read by dlworker.
LOCAL_ADDR_ENV = "PET_LOCAL_ADDR"
# dlfleet's older name for the same, read after LOCAL_ADDR_ENV. Set by the
# user; read by dlworker.
NODE_HOST_ENV = "DLFLEET_NODE_HOST"

# dlworker's settings, each the variable beside a flag (the flag wins). Set by
# the user; read by dlworker (`dlfleet.worker.agent.config`).
JOB_ENV = "DLFLEET_JOB"  # --job-name
NODE_NAME_ENV = "DLFLEET_NODE_NAME"  # --node-name
STEP_TIMEOUT_ENV = "DLFLEET_STEP_TIMEOUT"  # --step-timeout
STEP_TIMEOUT_FACTOR_ENV = "DLFLEET_STEP_TIMEOUT_FACTOR"  # --step-timeout-factor
STEP_TIMEOUT_MIN_ENV = "DLFLEET_STEP_TIMEOUT_MIN"  # --step-timeout-min
SPARES_ENV = "DLFLEET_SPARES"  # --spares
DIAGNOSIS_ENV = "DLFLEET_DIAGNOSIS"  # --diagnosis
DIAGNOSIS_RULES_ENV = "DLFLEET_DIAGNOSIS_RULES"  # --diagnosis-rules
NODE_CHECK_ENV = "DLFLEET_NODE_CHECK"  # --node-check
# How long the agent keeps trying an unreachable master (seconds). Set by the
# user; read by the agent.
CONNECT_BUDGET_ENV = "DLFLEET_CONNECT_BUDGET"
# Where the agent's checkpoint keeper puts its folder (default /dev/shm). Set
# by the user; read by the agent.
SHM_DIR_ENV = "DLFLEET_SHM_DIR"
# How long a rank whose collective failed waits for the agent to say a peer
# died (seconds). Set by the user; read by the in-process restart runner.
PEER_FAILURE_GRACE_ENV = "DLFLEET_PEER_FAILURE_GRACE"
# Test hook: nodes the node check makes slow. Set by tests and benches; read
# by the node check process (`dlfleet.worker.nodecheck`).
NODE_CHECK_SLOWDOWN_ENV = "DLFLEET_NODE_CHECK_SLOWDOWN"
# The file catalog's cache folder. Set by the user; read by the loader.
CATALOG_CACHE_ENV = "DLFLEET_CATALOG_CACHE"
# In a master Pod the DLFleetJob controller made: the resource's name (its
# status is written and its spec.nodes followed by the job supervisor).
RESOURCE_ENV = "DLFLEET_RESOURCE"

# dlbrain's token and database URL. Set by the user; read by dlbrain.
BRAIN_TOKEN_ENV = "DLFLEET_BRAIN_TOKEN"
BRAIN_DB_ENV = "DLFLEET_BRAIN_DB"
