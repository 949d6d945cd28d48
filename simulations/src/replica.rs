//! A simulated node's model replica is the real one: [`node::replica::Replica`] (real
//! forward/backward on real data, per-layer optimizers, its own data shard). Only the *time*
//! these computations take comes from the compute model.

pub use node::replica::Replica;
