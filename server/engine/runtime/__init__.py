"""Running a call: the block walker, the shards and their gates, micro-batches, compiled graphs, the pool."""
