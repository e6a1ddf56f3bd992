"""Which slot a new image goes into: the one policy of a rank's writer (its
own images) and of the agent that keeps a peer's replicas.

A folder keeps each rank's images in numbered slots, allocated as they are
first needed, at most `slots` of them. An image may still be restored while

- its step is the protected one (`keep_from`: the newest step its owner was
  told is committed and replicated, or the one being persisted), or newer:
  the master may yet commit it (its reports and replicas are on their way),
  and a restore after a killed rank takes the newest step every rank holds;
- it is the newest image held: a process killed while writing the next one
  leaves that one half-written.

A new image goes, in order, into the slot holding the same step (saved
again: the older image of it is history), into the oldest image no longer
needed, into a slot not used yet; only when none is left does it replace an
image that may still be needed (the oldest, never the protected step's
while there is another): the writer then has no *room*, and a caller that
can wait (the training step, for the agent's word) waits for room first.
With `keep_from` None nothing is committed: only the newest image is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from dlfleet.worker.checkpoint.errors import SlotError


class Held(NamedTuple):
    """The image one slot holds (a tuple: a writer lists every slot at each
    save, up to 64 of them, and a frozen dataclass costs 10x to make)."""

    slot: int
    round: int
    step: int


def slot_count(slots: int, memory_bytes: int | None, image_bytes: int) -> int:
    """How many slots a rank may use: `slots`, fewer where that many images
    of `image_bytes` would pass `memory_bytes` (never fewer than two: the
    protected image and the newest)."""
    if memory_bytes is None or image_bytes <= 0:
        return slots
    return max(min(slots, memory_bytes // image_bytes), min(slots, 2))


def choose(
    held: Sequence[Held], slots: int, *, step: int, keep_from: int | None
) -> tuple[int, bool]:
    """The slot for a new image of `step`, and whether there was room (no
    image that may still be restored is replaced)."""
    if slots < 1:
        raise ValueError(f"a folder needs at least one slot, got {slots}")
    for image in held:
        if image.step == step:
            return image.slot, True
    newest = max(held, key=lambda h: (h.round, h.step), default=None)

    def needed(image: Held) -> bool:
        if image is newest:
            return True
        return keep_from is not None and image.step >= keep_from

    spare = min((h for h in held if not needed(h)), key=lambda h: (h.step, h.round), default=None)
    if spare is not None:
        return spare.slot, True
    used = {h.slot for h in held}
    unused = [slot for slot in range(slots) if slot not in used]
    if unused:
        return unused[0], True
    by_age = sorted(held, key=lambda h: (h.step, h.round))
    for candidates in (
        [h for h in by_age if h is not newest and h.step != keep_from],
        [h for h in by_age if h.step != keep_from],
    ):
        if candidates:
            return candidates[0].slot, False
    raise SlotError(
        f"every one of the {slots} slots holds the protected step {keep_from}: "
        "give the writer more slots"
    )
