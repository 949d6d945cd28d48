//! Sharded sampler: each worker sees its own shard, reshuffled per epoch (like DistributedSampler).
