"""The training side: the `dlworker` agent and the ShardedDataLoader."""
