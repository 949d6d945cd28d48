//! dreamddp worker node: the sync strategies a node's local workers execute (ssgd, wfbp,
//! localsgd, dreamddp) — their per-step decisions in the sans-IO [`sync_machine`], the
//! multi-worker training loop that executes them ([`trainer`]), and the DreamDDP plan built
//! from a profile measured on this machine ([`planning`], [`profile`]), and, with feature
//! `nccl`, the NCCL collective (`nccl`) and the trainer's device-resident path over it
//! ([`device_sync`]). What every node
//! shares (task, replica, collectives, config) lives in the `node` crate.

pub mod device_sync;
pub mod gpu_probe;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod planning;
pub mod profile;
pub mod sync_machine;
pub mod trainer;
