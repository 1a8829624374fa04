"""Tensor parallelism inside one worker (`EngineConfig.tensor_parallel_size` N > 1).

The worker's process is rank 0: it keeps the scheduler, the block manager, the
sampler, gRPC and the KV transfer, and holds every rank's KV shard (KVCache.shards),
so nothing outside the engine sees more than one cache. Ranks 1..N-1 are processes
it spawns (rank.py); each holds only its shard of the weights (shard.py: whole
attention heads, GQA groups kept whole, and a slice of the MLP) and its own
KV shard, handed over at spawn. For every forward, rank 0 sends the step's inputs
to every rank (step.py) and all of them run their shard in lockstep; the outputs
of the o and down projections are partial sums that an all-reduce completes
(group.py: gloo on a CPU, NCCL on CUDA). Only rank 0 computes logits and samples.
"""
