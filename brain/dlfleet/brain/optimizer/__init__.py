"""The optimizer: pure functions from what a job measured to a `Decision`
with its reason and evidence. No I/O and no clock: time is an argument."""
