//! dreamddp node runner: one node's N local workers, the intra-node collective they
//! synchronize through, a link shaper that emulates a slower interconnect, and the
//! training loop that executes a sync strategy, whose per-step decisions live in the
//! sans-IO [`sync_machine`].

pub mod cluster_model;
pub mod collective;
pub mod layout;
pub mod link;
pub mod node;
pub mod planning;
pub mod profile;
pub mod replica;
pub mod sync_machine;
pub mod task;
pub mod thread_collective;
pub mod trainer;
