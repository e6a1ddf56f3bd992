"""The contract between dlfleet's components: the generated wire protocol
(`dlfleet.api.v1`), the error table, the permutation both sides compute, and
the client library agents and loaders use to talk to the master."""
