"""The `dlworker` agent, one per node: it joins the master's rendezvous, starts
the local training processes with torchrun's environment, watches them and
restarts them when the world changes or a worker fails.

The modules here that do not talk to the master are plain values and thin
process wrappers: `config` (flags and `PET_*` variables -> `AgentConfig`),
`env` (a round assignment -> each worker's environment) and `workers` (the
local process group of one round).
"""
