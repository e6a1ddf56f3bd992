"""Pure state machines of the master: `(state, event, now) -> (state, effects)`.
Nothing here imports grpc, sqlalchemy, kubernetes or torch, or reads a clock."""
