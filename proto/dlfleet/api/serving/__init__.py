"""What every dlfleet gRPC server shares: the master's (asyncio), the job
supervisor's control service (asyncio), the brain's and the node agent's
keeper (threads).

- `tokens`: the one token check (`TokenCheck`, `AsyncTokenCheck`);
- `guard`: the one request guard (a request that does not parse is
  INVALID_ARGUMENT, not UNKNOWN/INTERNAL);
- `answers`: domain errors answered with their status code, by the one table
  in `dlfleet.api.status`; status details bounded;
- `tls`: a server's TLS pair, read and checked as PEM;
- `flags`: the token and TLS command-line flags of `dlmaster` and `dlbrain`;
- `ports`: whether a port is free before a server binds it.

Imports only grpc, protobuf and `dlfleet.api`: every process may use it.
"""
