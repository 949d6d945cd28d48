//! The intra-node collective trait: asynchronous all-reduce of a bucket, with a handle the optimizer waits on.
//!
//! This module owns the backend-independent contract between a node's workers and
//! whatever moves their buckets: [`Collective`] (submit an all-reduce, get a
//! [`ReduceHandle`] back immediately), [`ReduceKey`] (which operation a submission
//! belongs to), [`CollectiveError`] (everything that can go wrong, typed), and
//! [`AbortOnPanic`] (a guard that poisons the collective when a worker thread dies, so
//! its peers get [`CollectiveError::PeerGone`] instead of waiting forever).
//!
//! Backends: `thread_collective::ThreadCollective` (worker threads of one process,
//! shaped by a link model) and, later, an NCCL backend whose handle wraps a CUDA
//! event on the communication stream. The handle is therefore a boxed
//! [`PendingReduce`] so each backend keeps its own completion machinery.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

/// Identifies one all-reduce operation. Every rank submits the same set of keys (one per
/// bucket per step), possibly in a different interleaving; submissions with equal keys
/// are reduced together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReduceKey {
    /// Training step (iteration) the bucket belongs to.
    pub step: u64,
    /// Bucket index within the step.
    pub bucket: u32,
}

impl ReduceKey {
    /// Key of bucket `bucket` in step `step`.
    pub fn new(step: u64, bucket: u32) -> Self {
        Self { step, bucket }
    }
}

impl fmt::Display for ReduceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} bucket {}", self.step, self.bucket)
    }
}

/// Everything that can go wrong in a collective operation.
///
/// `Clone` because one failure (e.g. a length mismatch) is reported to every rank that
/// waits on the failed operation.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CollectiveError {
    /// A rank submitted a vector whose length differs from the first submission for the
    /// same key. Every waiter of that operation receives this error.
    #[error(
        "all-reduce {key}: rank {rank} submitted {got} values but the operation has {expected}"
    )]
    LengthMismatch {
        /// The operation.
        key: ReduceKey,
        /// The rank whose submission did not match.
        rank: usize,
        /// Length of the first submission for this key.
        expected: usize,
        /// Length the mismatching rank submitted.
        got: usize,
    },
    /// A rank index outside `0..world`.
    #[error("rank {rank} out of range for a collective of world size {world}")]
    RankOutOfRange {
        /// The offending rank.
        rank: usize,
        /// World size of the collective.
        world: usize,
    },
    /// The same rank submitted the same key twice while the operation was still live.
    #[error("all-reduce {key}: rank {rank} submitted twice")]
    DuplicateSubmit {
        /// The operation.
        key: ReduceKey,
        /// The rank that submitted twice.
        rank: usize,
    },
    /// A peer is gone (a worker thread died, or the collective was shut down or dropped);
    /// the operation can never complete.
    #[error("collective peer gone: {reason}")]
    PeerGone {
        /// Why the collective was shut down.
        reason: String,
    },
    /// The peers did not all submit within the collective's timeout.
    #[error("all-reduce {key}: timed out after {waited:?} waiting for peers")]
    Timeout {
        /// The operation.
        key: ReduceKey,
        /// How long this rank waited.
        waited: Duration,
    },
    /// A collective must have at least one rank.
    #[error("a collective needs at least one rank")]
    EmptyWorld,
    /// An error reported by the communication backend itself (e.g. NCCL, CUDA).
    #[error("{backend} collective failed: {message}")]
    Backend {
        /// Backend name, as [`Collective::name`].
        backend: &'static str,
        /// The backend's message.
        message: String,
    },
}

/// Backend-specific state of one submitted all-reduce, as seen by one rank.
///
/// Implemented by each backend; callers use it through [`ReduceHandle`].
pub trait PendingReduce: Send {
    /// True when [`PendingReduce::wait`] would return without blocking.
    fn is_ready(&self) -> bool;
    /// Blocks until the operation completes (or fails) and returns this rank's copy of
    /// the reduced values.
    fn wait(self: Box<Self>) -> Result<Vec<f32>, CollectiveError>;
}

/// One rank's handle to an all-reduce in flight. Wait on it before touching the layers
/// whose values were submitted. Dropping it without waiting abandons this rank's copy of
/// the result (the operation itself still completes for the other ranks).
pub struct ReduceHandle {
    key: ReduceKey,
    pending: Box<dyn PendingReduce>,
}

impl fmt::Debug for ReduceHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReduceHandle")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl ReduceHandle {
    /// Wraps a backend's pending operation.
    pub fn new(key: ReduceKey, pending: Box<dyn PendingReduce>) -> Self {
        Self { key, pending }
    }

    /// A handle whose result is already known (e.g. a world of one rank).
    pub fn ready(key: ReduceKey, values: Vec<f32>) -> Self {
        Self::new(key, Box::new(Completed(values)))
    }

    /// The operation this handle belongs to.
    pub fn key(&self) -> ReduceKey {
        self.key
    }

    /// True when [`ReduceHandle::wait`] would return without blocking.
    pub fn is_ready(&self) -> bool {
        self.pending.is_ready()
    }

    /// Blocks until the all-reduce completes and returns the mean over all ranks.
    pub fn wait(self) -> Result<Vec<f32>, CollectiveError> {
        self.pending.wait()
    }
}

/// An already completed operation.
struct Completed(Vec<f32>);

impl PendingReduce for Completed {
    fn is_ready(&self) -> bool {
        true
    }

    fn wait(self: Box<Self>) -> Result<Vec<f32>, CollectiveError> {
        Ok(self.0)
    }
}

/// An all-reduce among the `world` workers of one node.
///
/// Submission never blocks on peers: [`Collective::all_reduce_mean`] hands the values to
/// the backend and returns a [`ReduceHandle`]; the worker keeps computing and waits on the
/// handle later. Every rank must submit the same keys with vectors of equal length.
pub trait Collective: Send + Sync {
    /// Number of ranks.
    fn world(&self) -> usize;

    /// Starts an all-reduce (element-wise mean over all ranks) of `data` for operation
    /// `key` on behalf of `rank`. Errors that are known at submission (bad rank, duplicate
    /// submission, collective shut down) are returned here; errors that depend on the
    /// peers (length mismatch, timeout, a peer dying) are returned by the handle's `wait`.
    fn all_reduce_mean(
        &self,
        rank: usize,
        key: ReduceKey,
        data: Vec<f32>,
    ) -> Result<ReduceHandle, CollectiveError>;

    /// Bytes `rank` has sent so far (ring all-reduce accounting, see
    /// [`crate::link::LinkModel::ring_allreduce_bytes_per_rank`]); 0 for a rank out of range.
    fn bytes_sent(&self, rank: usize) -> u64;

    /// Short backend name for logs and reports (`"thread"`, `"nccl"`).
    fn name(&self) -> &'static str;

    /// Poisons the collective: every pending and future wait and submission fails with
    /// [`CollectiveError::PeerGone`] carrying `reason`. Idempotent; the first reason wins.
    fn shutdown(&self, reason: &str);
}

/// Guard a worker thread holds for its lifetime: if the thread unwinds from a panic, the
/// guard shuts the collective down so the other ranks' waits return
/// [`CollectiveError::PeerGone`] instead of hanging. Does nothing on a normal drop.
pub struct AbortOnPanic<'a> {
    collective: &'a dyn Collective,
    rank: usize,
}

impl fmt::Debug for AbortOnPanic<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AbortOnPanic")
            .field("collective", &self.collective.name())
            .field("rank", &self.rank)
            .finish()
    }
}

impl<'a> AbortOnPanic<'a> {
    /// Arms the guard for worker `rank` of `collective`.
    pub fn new(collective: &'a dyn Collective, rank: usize) -> Self {
        Self { collective, rank }
    }
}

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.collective
                .shutdown(&format!("worker rank {} panicked", self.rank));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_handle_returns_its_values() {
        let handle = ReduceHandle::ready(ReduceKey::new(3, 1), vec![1.0, 2.0]);
        assert!(handle.is_ready());
        assert_eq!(handle.key(), ReduceKey::new(3, 1));
        assert_eq!(handle.wait().unwrap(), vec![1.0, 2.0]);
    }

    #[test]
    fn keys_order_by_step_then_bucket() {
        assert!(ReduceKey::new(1, 9) < ReduceKey::new(2, 0));
        assert!(ReduceKey::new(2, 0) < ReduceKey::new(2, 1));
        assert_eq!(ReduceKey::new(4, 2).to_string(), "step 4 bucket 2");
    }

    #[test]
    fn errors_name_the_operation() {
        let err = CollectiveError::LengthMismatch {
            key: ReduceKey::new(7, 2),
            rank: 1,
            expected: 10,
            got: 9,
        };
        let text = err.to_string();
        assert!(text.contains("step 7 bucket 2"), "{text}");
        assert!(text.contains("rank 1"), "{text}");
        assert!(text.contains("10") && text.contains('9'), "{text}");
    }
}
