"""In-memory checkpoints (SPEC section 10): images of each rank's state in the
node's shared memory, restore with resharding, persistence in the
torch.distributed.checkpoint folder format.

`files`, `errors` and `presence` import no torch, so that the node agent can
use them.
"""
