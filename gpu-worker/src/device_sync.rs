//! The trainer's device-resident sync path: what a collective that reduces in GPU memory
//! (NCCL) offers the trainer, so units whose tensors live on that GPU are staged, reduced and
//! landed without passing through the host.
//!
//! A collective's buffer is built from [`StagedPiece`]s in the sync machine's staging order:
//! a unit's device runs ([`DeviceSpan`], copied device to device on the compute stream) or
//! host values (a unit that lives on the host, e.g. a CPU worker of a mixed node). Whatever
//! a rank's pieces are, its submission is one all-reduce of the bucket's length, the same
//! NCCL operation the host-staged path submits, so ranks mixing both paths stay in step.
//!
//! Like PyTorch DDP's default bucketing (gradients copied into a flat bucket, all-reduced,
//! copied back), the bucket is a device buffer of its own: gradients are copied once each
//! way, device to device; parameters must be, since the next forward reads a unit's own
//! values while its average is in flight (an in-place all-reduce would race it).
//!
//! Only [`engine::outer::Landing::Replace`] plans take this path: rebasing (`dreamddp` with a
//! delay over one step) and the outer optimizers (`diloco`, `streaming-diloco`) do their
//! arithmetic on the host and keep the host-staged path.

use engine::replica::DeviceSpan;
use node::collective::{CollectiveError, ReduceKey};

/// One unit's part of a collective's buffer.
#[derive(Clone, Debug, PartialEq)]
pub enum StagedPiece {
    /// Runs of the rank's GPU memory (a unit's tensors), copied when the collective launches.
    Device(Vec<DeviceSpan>),
    /// Values a host-resident unit appended.
    Host(Vec<f32>),
}

impl StagedPiece {
    /// Length in `f32` values.
    pub fn len(&self) -> usize {
        match self {
            Self::Device(spans) => spans.iter().map(|s| s.len).sum(),
            Self::Host(v) => v.len(),
        }
    }

    /// True when the piece has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A collective that can reduce buffers in the GPU memory of each rank's device.
pub trait DeviceCollective: Send + Sync {
    /// The CUDA device rank `rank` reduces on.
    fn device_of(&self, rank: usize) -> usize;

    /// Builds the buffer of collective `key` from `pieces` (in order) on rank `rank`'s GPU,
    /// after the work already queued on its compute stream, and starts its mean all-reduce on
    /// the communication stream; returns at once.
    ///
    /// # Safety
    /// Every [`StagedPiece::Device`] run must be device memory of [`Self::device_of`]`(rank)`
    /// holding `len` `f32`s, and stay allocated until the compute stream has passed this
    /// call's copies (anything queued later on that stream may reuse it).
    ///
    /// # Errors
    /// [`CollectiveError::Backend`] when CUDA or NCCL fails, [`CollectiveError::PeerGone`]
    /// after a shutdown.
    unsafe fn launch_pieces(
        &self,
        rank: usize,
        key: ReduceKey,
        pieces: &[StagedPiece],
    ) -> Result<Box<dyn DeviceLanding>, CollectiveError>;
}

/// A device-resident all-reduce in flight, then its result until every unit has landed.
pub trait DeviceLanding: Send {
    /// Orders the rank's compute stream after the all-reduce (the host does not block).
    ///
    /// # Errors
    /// [`CollectiveError::Backend`].
    fn order_compute(&self) -> Result<(), CollectiveError>;

    /// Copies result values `offset..` into `dst` runs in order, on the compute stream;
    /// runs without memory are skipped (their values are not written anywhere).
    ///
    /// # Safety
    /// Every run with memory must be device memory of the rank's GPU holding `len` `f32`s;
    /// [`Self::order_compute`] must have been called.
    ///
    /// # Errors
    /// [`CollectiveError::Backend`], also when the runs reach past the result.
    unsafe fn write_to_device(
        &self,
        offset: usize,
        dst: &[DeviceSpan],
    ) -> Result<(), CollectiveError>;

    /// Result values `offset..offset + len` on the host (blocks until they are there).
    ///
    /// # Errors
    /// [`CollectiveError::Backend`], also when the range reaches past the result.
    fn read_to_host(&self, offset: usize, len: usize) -> Result<Vec<f32>, CollectiveError>;

    /// Length of the result in `f32` values.
    fn len(&self) -> usize;

    /// True when the result is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
