//! One NCCL rank on one GPU: in-place all-reduce of device buffers another library owns
//! (libtorch's CUDA tensors), on a communication stream of its own, ordered against the
//! compute stream by CUDA events — the PyTorch DDP recipe:
//!
//! 1. [`NcclRank::launch`] records an event on the compute stream (the unit's gradients or
//!    updated parameters are ready there), makes the communication stream wait on it, and
//!    enqueues one `ncclAllReduce` per buffer (one NCCL group) on the communication stream;
//!    the host returns at once and backward goes on.
//! 2. [`PendingDeviceReduce::order_compute`] makes the compute stream wait on the
//!    communication stream's event before the unit's values are touched again (its
//!    optimizer step, the next forward).
//!
//! Buffers are raw device pointers ([`DeviceBuffer`]): nothing here allocates or frees them,
//! so torch-owned memory is never handed to a cudarc type that would free it. The caller keeps
//! the tensors alive until the compute stream has waited on the handle.
//!
//! The compute stream is the device's legacy default stream, which is libtorch's current
//! stream unless a caller installed another. The communication stream is non-blocking, so the
//! default stream's implicit synchronization does not serialize it behind compute.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::{result, sys};

use super::{cuda_err, nccl_err, NcclError};
use crate::gpu_probe::{probe_nccl, quiet_catch};

/// How the ranks' buffers are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReductionOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean (`ncclAvg`): parameter averaging (dreamddp, localsgd) and gradient
    /// averaging (ssgd, wfbp) alike.
    Avg,
}

impl ReductionOp {
    fn nccl(self) -> sys::ncclRedOp_t {
        match self {
            Self::Sum => sys::ncclRedOp_t::ncclSum,
            Self::Avg => sys::ncclRedOp_t::ncclAvg,
        }
    }
}

/// A contiguous `f32` buffer in device memory owned by someone else (a tensor's `data_ptr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    /// Device address of the first element.
    pub ptr: u64,
    /// Number of `f32` elements.
    pub len: usize,
}

/// An NCCL communicator handle; destroyed (after its work finished) on drop.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `NcclRank` methods take `&self` but every user holds the rank exclusively
// (one worker thread per GPU, or a Mutex in `NcclCollective`).
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInit*, is destroyed once, and the owning rank
        // synchronized its communication stream first.
        let _ = unsafe { result::comm_destroy(self.0) };
    }
}

/// One rank of an NCCL communicator, bound to one GPU.
pub struct NcclRank {
    // Dropped first: the communicator goes before its stream and context.
    comm: RawComm,
    compute: Arc<CudaStream>,
    comm_stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    rank: usize,
    world: usize,
    device: usize,
}

impl std::fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclRank")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl Drop for NcclRank {
    fn drop(&mut self) {
        let _ = self.comm_stream.synchronize();
    }
}

/// A device's context (the primary context libtorch also uses) and a non-blocking stream.
fn context_and_stream(device: usize) -> Result<(Arc<CudaContext>, Arc<CudaStream>), NcclError> {
    let ctx =
        quiet_catch(|| CudaContext::new(device))?.map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
    // SAFETY: every buffer this module touches is ordered by its own events (module doc);
    // cudarc's per-slice event tracking would add a record per access.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
    Ok((ctx, stream))
}

impl NcclRank {
    /// One communicator over `devices` (one rank per device, rank `i` on `devices[i]`) for a
    /// single process driving them all (`ncclCommInitAll`).
    ///
    /// # Errors
    /// [`NcclError::Probe`] when CUDA or NCCL is unusable, [`NcclError::TooFewDevices`] when a
    /// device index is not visible, [`NcclError::Cuda`]/[`NcclError::Nccl`] when setup fails.
    pub fn init_all(devices: &[usize]) -> Result<Vec<Self>, NcclError> {
        let info = probe_nccl()?;
        if devices.iter().any(|&d| d >= info.devices) || devices.is_empty() {
            return Err(NcclError::TooFewDevices {
                ranks: devices.len(),
                devices: info.devices,
            });
        }
        let mut parts = Vec::with_capacity(devices.len());
        for &d in devices {
            parts.push(context_and_stream(d)?);
        }
        let n = devices.len();
        let ordinals: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); n];
        // SAFETY: `comms` has room for `n` handles and `ordinals` names `n` visible devices.
        quiet_catch(|| unsafe {
            result::comm_init_all(comms.as_mut_ptr(), n as i32, ordinals.as_ptr())
        })?
        .map_err(nccl_err("ncclCommInitAll"))?;
        for (rank, &comm) in comms.iter().enumerate() {
            tracing::info!(
                "NCCL communicator {comm:p}: rank {rank} of {n} on cuda:{}",
                devices[rank]
            );
        }
        Ok(parts
            .into_iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, ((ctx, comm_stream), comm))| Self {
                comm: RawComm(comm),
                compute: ctx.default_stream(),
                comm_stream,
                ctx,
                rank,
                world: n,
                device: devices[rank],
            })
            .collect())
    }

    /// A fresh NCCL unique id for [`NcclRank::from_rank`]: made once (rank 0) and shared with
    /// every rank at start (128 bytes).
    ///
    /// # Errors
    /// [`NcclError::Probe`] or [`NcclError::Nccl`].
    pub fn unique_id() -> Result<[u8; 128], NcclError> {
        probe_nccl()?;
        let id = quiet_catch(result::get_uniqueid)?.map_err(nccl_err("ncclGetUniqueId"))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// This process's rank `rank` of `world` on `device`, joined through `id` (one process or
    /// thread per GPU; `ncclCommInitRank` blocks until every rank joined).
    ///
    /// # Errors
    /// As [`NcclRank::init_all`].
    pub fn from_rank(
        device: usize,
        rank: usize,
        world: usize,
        id: &[u8; 128],
    ) -> Result<Self, NcclError> {
        let info = probe_nccl()?;
        if device >= info.devices {
            return Err(NcclError::TooFewDevices {
                ranks: device + 1,
                devices: info.devices,
            });
        }
        let (ctx, comm_stream) = context_and_stream(device)?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is written by NCCL; rank and world were checked to fit an i32 range
        // by construction (a rank count larger than i32 cannot have joined).
        quiet_catch(|| unsafe {
            result::comm_init_rank(&mut comm, world as i32, id, rank as i32)
        })?
        .map_err(nccl_err("ncclCommInitRank"))?;
        Ok(Self {
            comm: RawComm(comm),
            compute: ctx.default_stream(),
            comm_stream,
            ctx,
            rank,
            world,
            device,
        })
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The CUDA device index.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The communication stream (host-staged copies run on it too).
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm_stream
    }

    /// The compute stream: the device's legacy default stream, libtorch's current stream.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// Copies `len` `f32`s from `src` to `dst` (device to device) on the compute stream.
    ///
    /// # Safety
    /// Both must be device memory of this rank's GPU holding `len` `f32`s, alive until the
    /// compute stream has passed the copy.
    ///
    /// # Errors
    /// [`NcclError::Cuda`].
    pub unsafe fn copy_on_compute(&self, dst: u64, src: u64, len: usize) -> Result<(), NcclError> {
        self.bind()?;
        // SAFETY: the caller's contract.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, len * 4, self.compute.cu_stream())
        }
        .map_err(cuda_err("cuMemcpyDtoDAsync"))
    }

    /// Makes this rank's context current on the calling thread (raw driver calls need it).
    ///
    /// # Errors
    /// [`NcclError::Cuda`].
    pub fn bind(&self) -> Result<(), NcclError> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))
    }

    /// Records an event on the compute stream now (with timing when `timed`).
    ///
    /// # Errors
    /// [`NcclError::Cuda`].
    pub fn mark_compute(&self, timed: bool) -> Result<CudaEvent, NcclError> {
        let e = self.event(timed)?;
        e.record(&self.compute).map_err(cuda_err("cuEventRecord"))?;
        Ok(e)
    }

    fn event(&self, timed: bool) -> Result<CudaEvent, NcclError> {
        let flags = if timed {
            CUevent_flags::CU_EVENT_DEFAULT
        } else {
            CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        self.ctx
            .new_event(Some(flags))
            .map_err(cuda_err("cuEventCreate"))
    }

    /// Starts the in-place all-reduce of `buffers` (one NCCL group) on the communication
    /// stream once the compute stream's work so far is done; returns at once. With `timed`,
    /// the handle carries start and end events ([`PendingDeviceReduce::timing`]).
    ///
    /// # Safety
    /// Every buffer must be valid device memory of this rank's device, `len` `f32`s long, and
    /// stay allocated, and untouched by other streams, until the compute stream has waited
    /// on the returned handle ([`PendingDeviceReduce::order_compute`]) or it completed.
    ///
    /// # Errors
    /// [`NcclError::Cuda`] or [`NcclError::Nccl`] (an asynchronous NCCL failure shows later,
    /// as an error of the waiting call).
    pub unsafe fn launch(
        &self,
        buffers: &[DeviceBuffer],
        op: ReductionOp,
        timed: bool,
    ) -> Result<PendingDeviceReduce, NcclError> {
        self.bind()?;
        let ready = self.mark_compute(false)?;
        self.comm_stream
            .wait(&ready)
            .map_err(cuda_err("cuStreamWaitEvent"))?;
        let start = if timed {
            let e = self.event(true)?;
            e.record(&self.comm_stream)
                .map_err(cuda_err("cuEventRecord"))?;
            Some(e)
        } else {
            None
        };
        // SAFETY: the caller guarantees the buffers; the communicator and the stream are
        // this rank's and alive.
        unsafe { self.enqueue(buffers, op)? };
        let done = self.event(timed)?;
        done.record(&self.comm_stream)
            .map_err(cuda_err("cuEventRecord"))?;
        Ok(PendingDeviceReduce {
            done,
            start,
            compute: self.compute.clone(),
        })
    }

    /// Enqueues the all-reduces on the communication stream (no ordering against compute).
    ///
    /// # Safety
    /// As [`NcclRank::launch`].
    pub(super) unsafe fn enqueue(
        &self,
        buffers: &[DeviceBuffer],
        op: ReductionOp,
    ) -> Result<(), NcclError> {
        result::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let mut outcome = Ok(());
        for b in buffers.iter().filter(|b| b.len > 0) {
            let ptr = b.ptr as *mut c_void;
            // SAFETY: see the caller's contract; in place (send buffer = receive buffer) is
            // allowed by NCCL.
            let r = unsafe {
                result::all_reduce(
                    ptr,
                    ptr,
                    b.len,
                    sys::ncclDataType_t::ncclFloat32,
                    op.nccl(),
                    self.comm.0,
                    self.comm_stream.cu_stream() as _,
                )
            };
            if let Err(e) = r {
                outcome = Err(NcclError::Nccl {
                    call: "ncclAllReduce",
                    message: format!(
                        "{} (communicator {:p}, rank {} of {} on cuda:{})",
                        super::describe_nccl(e.0, self.comm.0),
                        self.comm.0,
                        self.rank,
                        self.world,
                        self.device
                    ),
                });
                break;
            }
        }
        let end = result::group_end().map_err(|e| NcclError::Nccl {
            call: "ncclGroupEnd",
            message: super::describe_nccl(e.0, self.comm.0),
        });
        outcome.and(end.map(|_| ()))
    }
}

/// Start and end of one all-reduce on the communication stream, in ms after a base event.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReduceTiming {
    /// When the communication stream began the all-reduce.
    pub start_ms: f64,
    /// When it finished.
    pub end_ms: f64,
}

/// An all-reduce in flight on the communication stream.
pub struct PendingDeviceReduce {
    done: CudaEvent,
    start: Option<CudaEvent>,
    compute: Arc<CudaStream>,
}

impl std::fmt::Debug for PendingDeviceReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingDeviceReduce")
            .finish_non_exhaustive()
    }
}

impl PendingDeviceReduce {
    /// Makes the compute stream wait for the all-reduce (GPU side; the host does not block).
    ///
    /// # Errors
    /// [`NcclError::Cuda`].
    pub fn order_compute(&self) -> Result<(), NcclError> {
        self.compute
            .wait(&self.done)
            .map_err(cuda_err("cuStreamWaitEvent"))
    }

    /// True when the all-reduce finished (false on error too; [`Self::synchronize`] reports it).
    pub fn is_complete(&self) -> bool {
        self.done.is_complete()
    }

    /// Blocks the host until the all-reduce finished.
    ///
    /// # Errors
    /// [`NcclError::Cuda`].
    pub fn synchronize(&self) -> Result<(), NcclError> {
        self.done
            .synchronize()
            .map_err(cuda_err("cuEventSynchronize"))
    }

    /// Start and end after `base` (an event recorded with timing on the same device), when
    /// launched with `timed`; blocks until the all-reduce finished.
    ///
    /// # Errors
    /// [`NcclError::Cuda`].
    pub fn timing(&self, base: &CudaEvent) -> Result<Option<ReduceTiming>, NcclError> {
        let Some(start) = &self.start else {
            return Ok(None);
        };
        let start_ms = base
            .elapsed_ms(start)
            .map_err(cuda_err("cuEventElapsedTime"))?;
        let end_ms = base
            .elapsed_ms(&self.done)
            .map_err(cuda_err("cuEventElapsedTime"))?;
        Ok(Some(ReduceTiming {
            start_ms: f64::from(start_ms),
            end_ms: f64::from(end_ms),
        }))
    }
}
