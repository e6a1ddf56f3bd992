"""The training master: shard service, node liveness, rendezvous, and the
durable store behind them. Importing it never imports torch."""
