//! What every dreamddp training node shares, whatever its role (GPU/CPU worker node, edge
//! agent) and what the aggregators and the simulator need of it:
//!
//! * [`backend`]: which compute backend (built-in, tch) a node's replicas run on;
//! * [`cluster_model`]: the `[model]` section of every process config, config reading with
//!   `--set` overrides, durable (atomic) file writes;
//! * [`layout`]: the sync layout (model layer → wire `layer_id`);
//! * [`task`]: what a node trains (model + data + defaults);
//! * [`data_shards`]: which training samples a process holds and how its ranks draw them;
//! * [`replica`]: one model replica with its optimizers and data shard;
//! * [`collective`], [`thread_collective`], [`link`]: the intra-node collective contract, its
//!   thread backend and the link model that shapes it;
//! * [`memory`]: the process's resident memory and CPU time (stats, `/metrics`);
//! * [`latency`]: the latency histogram nodes record delta→ack times in;
//! * [`training`]: a node's N-worker training loop with the leader hook through which it
//!   talks to the rest of the cluster.

pub mod backend;
pub mod cluster_model;
pub mod collective;
pub mod data_shards;
pub mod latency;
pub mod layout;
pub mod link;
pub mod memory;
pub mod replica;
pub mod task;
pub mod thread_collective;
pub mod training;
