//! [`NcclCollective`]: the node's [`Collective`] over NCCL for workers whose values live on the
//! host (the built-in engine, or tch replicas handing units over as host vectors): each
//! submission is copied to its rank's GPU, all-reduced (`ncclAvg`) in place on the rank's
//! communication stream, and copied back when the handle is waited on. This is the
//! host-staged path (host-resident workers, and plans whose landing needs host arithmetic);
//! units whose tensors are on the rank's GPU take the device path of [`super::staged`].
//!
//! NCCL matches operations by order, not by key: every rank must submit its buckets in the
//! same order (the sync machine does: every worker runs the same plan). World `w` puts rank
//! `r` on GPU `r`. Like PyTorch's `ProcessGroupNCCL`, the communicator is made lazily: each
//! rank joins (`ncclCommInitRank`, one unique id made up front) on its first submission, from
//! its own worker thread, once that thread has set up its model on the GPU. (The NCCL it
//! calls is the one libtorch loaded: see [`crate::gpu_probe::loaded_nccl`].)
//! With several GPUs a rank's first submission blocks until every rank has joined.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};
use node::collective::{Collective, CollectiveError, PendingReduce, ReduceHandle, ReduceKey};
use node::link::LinkModel;

use super::device::{DeviceBuffer, NcclRank, ReductionOp};
use super::{cuda_err, NcclError};

/// The NCCL collective over the first `world` GPUs of this process.
pub struct NcclCollective {
    id: [u8; 128],
    ranks: Vec<Mutex<Option<NcclRank>>>,
    bytes: Vec<AtomicU64>,
    /// Why the collective was shut down (`Some`: every submission fails).
    shut_down: Mutex<Option<String>>,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("world", &self.ranks.len())
            .finish_non_exhaustive()
    }
}

impl NcclCollective {
    /// One rank per GPU `0..world`.
    ///
    /// # Errors
    /// See [`NcclRank::init_all`].
    pub fn new(world: usize) -> Result<Self, NcclError> {
        let info = crate::gpu_probe::probe_nccl()?;
        if world == 0 || world > info.devices {
            return Err(NcclError::TooFewDevices {
                ranks: world,
                devices: info.devices,
            });
        }
        Ok(Self {
            id: NcclRank::unique_id()?,
            bytes: (0..world).map(|_| AtomicU64::new(0)).collect(),
            ranks: (0..world).map(|_| Mutex::new(None)).collect(),
            shut_down: Mutex::new(None),
        })
    }

    /// Runs `f` with rank `rank`, joining the communicator on the rank's first use.
    pub(super) fn with_rank<R>(
        &self,
        rank: usize,
        f: impl FnOnce(&NcclRank) -> Result<R, NcclError>,
    ) -> Result<R, CollectiveError> {
        let world = self.ranks.len();
        let slot = self
            .ranks
            .get(rank)
            .ok_or(CollectiveError::RankOutOfRange { rank, world })?;
        if let Some(gone) = self.gone() {
            return Err(gone);
        }
        let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        let nccl = match &mut *guard {
            Some(joined) => joined,
            empty => empty.insert(
                NcclRank::from_rank(rank, rank, world, &self.id).map_err(|e| backend_error(&e))?,
            ),
        };
        f(nccl).map_err(|e| backend_error(&e))
    }

    /// Counts the ring all-reduce bytes of `values` `f32`s for `rank`.
    pub(super) fn count_bytes(&self, rank: usize, values: usize) {
        let bytes = LinkModel::ring_allreduce_bytes_per_rank(values * 4, self.ranks.len());
        if let Some(b) = self.bytes.get(rank) {
            b.fetch_add(bytes as u64, Ordering::Relaxed);
        }
    }

    /// `PeerGone` with the shutdown reason, when the collective was shut down.
    fn gone(&self) -> Option<CollectiveError> {
        let reason = self.shut_down.lock().unwrap_or_else(|p| p.into_inner());
        reason
            .clone()
            .map(|reason| CollectiveError::PeerGone { reason })
    }

    fn submit(&self, rank: &NcclRank, data: &[f32]) -> Result<HostStaged, NcclError> {
        let stream = rank.comm_stream().clone();
        let buffer: CudaSlice<f32> = stream.clone_htod(data).map_err(cuda_err("cuMemcpyHtoD"))?;
        let ptr = {
            let (ptr, _sync) = buffer.device_ptr(&stream);
            ptr
        };
        let whole = [DeviceBuffer {
            ptr,
            len: data.len(),
        }];
        // SAFETY: `buffer` is this rank's device memory of `len` f32s, written on the same
        // stream before the all-reduce, and kept alive in the handle until the copy back.
        unsafe { rank.enqueue(&whole, ReductionOp::Avg)? };
        let done = stream
            .context()
            .new_event(None)
            .map_err(cuda_err("cuEventCreate"))?;
        done.record(&stream).map_err(cuda_err("cuEventRecord"))?;
        Ok(HostStaged {
            buffer,
            stream,
            done,
        })
    }
}

pub(super) fn backend_error(e: &NcclError) -> CollectiveError {
    CollectiveError::Backend {
        backend: "nccl",
        message: e.to_string(),
    }
}

/// A host-staged all-reduce in flight: the device copy, its stream, its completion event.
struct HostStaged {
    buffer: CudaSlice<f32>,
    stream: Arc<CudaStream>,
    done: CudaEvent,
}

impl PendingReduce for HostStaged {
    fn is_ready(&self) -> bool {
        self.done.is_complete()
    }

    fn wait(self: Box<Self>) -> Result<Vec<f32>, CollectiveError> {
        self.stream
            .clone_dtoh(&self.buffer)
            .and_then(|v| self.stream.synchronize().map(|()| v))
            .map_err(|e| backend_error(&cuda_err("cuMemcpyDtoH")(e)))
    }
}

impl Collective for NcclCollective {
    fn world(&self) -> usize {
        self.ranks.len()
    }

    fn all_reduce_mean(
        &self,
        rank: usize,
        key: ReduceKey,
        data: Vec<f32>,
    ) -> Result<ReduceHandle, CollectiveError> {
        let pending = self.with_rank(rank, |nccl| self.submit(nccl, &data))?;
        self.count_bytes(rank, data.len());
        Ok(ReduceHandle::new(key, Box::new(pending)))
    }

    fn bytes_sent(&self, rank: usize) -> u64 {
        self.bytes
            .get(rank)
            .map_or(0, |b| b.load(Ordering::Relaxed))
    }

    fn name(&self) -> &'static str {
        "nccl"
    }

    fn shutdown(&self, reason: &str) {
        let mut r = self.shut_down.lock().unwrap_or_else(|p| p.into_inner());
        r.get_or_insert_with(|| reason.to_string());
    }
}
