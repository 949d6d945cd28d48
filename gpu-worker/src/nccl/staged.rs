//! [`DeviceCollective`] for [`NcclCollective`]: a bucket built in the rank's GPU memory from
//! the units' device runs (device-to-device copies on the compute stream, in staging order),
//! all-reduced (`ncclAvg`) on the communication stream after an event on the compute stream
//! ([`NcclRank::launch`]), and copied back into the units on the compute stream once it has
//! waited on the all-reduce. The host never blocks on the device: ordering is by events.
//!
//! The bucket is allocated stream-ordered on the compute stream, and freed there too (when
//! the landing is dropped, after the compute stream was made to wait on the all-reduce), so
//! its memory cannot be reused while NCCL still reads it.

use std::sync::Arc;

use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr};
use engine::replica::DeviceSpan;
use node::collective::{CollectiveError, ReduceKey};

use super::device::{DeviceBuffer, NcclRank, PendingDeviceReduce, ReductionOp};
use super::host::backend_error;
use super::{cuda_err, NcclCollective, NcclError};
use crate::device_sync::{DeviceCollective, DeviceLanding, StagedPiece};

impl DeviceCollective for NcclCollective {
    fn device_of(&self, rank: usize) -> usize {
        rank
    }

    unsafe fn launch_pieces(
        &self,
        rank: usize,
        _key: ReduceKey,
        pieces: &[StagedPiece],
    ) -> Result<Box<dyn DeviceLanding>, CollectiveError> {
        let total: usize = pieces.iter().map(StagedPiece::len).sum();
        // SAFETY: the caller's contract covers the pieces' device runs.
        let landing = self.with_rank(rank, |nccl| unsafe { launch(nccl, pieces, total) })?;
        self.count_bytes(rank, total);
        Ok(Box::new(landing))
    }
}

/// Builds the bucket from `pieces` and starts its all-reduce (see the module doc).
///
/// # Safety
/// As [`DeviceCollective::launch_pieces`].
unsafe fn launch(
    nccl: &NcclRank,
    pieces: &[StagedPiece],
    total: usize,
) -> Result<StagedLanding, NcclError> {
    nccl.bind()?;
    let compute = nccl.compute_stream().clone();
    // SAFETY: every value of the bucket is written below (copy or zero fill) before the
    // all-reduce reads it.
    let bucket: CudaSlice<f32> =
        unsafe { compute.alloc::<f32>(total.max(1)) }.map_err(cuda_err("cuMemAllocAsync"))?;
    let base = bucket_address(&bucket, &compute);
    let stream = compute.cu_stream();
    let mut at = 0usize;
    for piece in pieces {
        match piece {
            StagedPiece::Device(spans) => {
                for s in spans {
                    let dst = base + (at * 4) as u64;
                    // SAFETY: `dst..dst + 4·len` is inside the bucket (the pieces' lengths
                    // add up to `total`); the source run is the caller's.
                    unsafe {
                        match s.ptr {
                            Some(src) => result::memcpy_dtod_async(dst, src, s.len * 4, stream)
                                .map_err(cuda_err("cuMemcpyDtoDAsync"))?,
                            None => result::memset_d8_async(dst, 0, s.len * 4, stream)
                                .map_err(cuda_err("cuMemsetD8Async"))?,
                        }
                    }
                    at += s.len;
                }
            }
            StagedPiece::Host(values) => {
                // SAFETY: inside the bucket as above; a pageable source is staged by the
                // driver before the call returns.
                unsafe { result::memcpy_htod_async(base + (at * 4) as u64, values, stream) }
                    .map_err(cuda_err("cuMemcpyHtoDAsync"))?;
                at += values.len();
            }
        }
    }
    let whole = [DeviceBuffer {
        ptr: base,
        len: total,
    }];
    // SAFETY: the bucket is this rank's device memory of `total` f32s, filled on the compute
    // stream before `launch` records its ready event there, and kept (with its free ordered
    // after the all-reduce) by the landing.
    let pending = unsafe { nccl.launch(&whole, ReductionOp::Avg, false)? };
    Ok(StagedLanding {
        pending,
        bucket,
        compute,
        len: total,
    })
}

fn bucket_address(bucket: &CudaSlice<f32>, stream: &Arc<CudaStream>) -> u64 {
    let (ptr, _sync) = bucket.device_ptr(stream);
    ptr
}

/// A bucket in flight, then its average until every unit has landed.
struct StagedLanding {
    pending: PendingDeviceReduce,
    bucket: CudaSlice<f32>,
    compute: Arc<CudaStream>,
    len: usize,
}

impl StagedLanding {
    fn check_range(&self, offset: usize, len: usize) -> Result<(), CollectiveError> {
        if offset.checked_add(len).is_some_and(|end| end <= self.len) {
            Ok(())
        } else {
            Err(CollectiveError::Backend {
                backend: "nccl",
                message: format!(
                    "values {offset}..{} asked of a bucket of {}",
                    offset.saturating_add(len),
                    self.len
                ),
            })
        }
    }
}

impl DeviceLanding for StagedLanding {
    fn order_compute(&self) -> Result<(), CollectiveError> {
        self.pending.order_compute().map_err(|e| backend_error(&e))
    }

    unsafe fn write_to_device(
        &self,
        offset: usize,
        dst: &[DeviceSpan],
    ) -> Result<(), CollectiveError> {
        let total: usize = dst.iter().map(|s| s.len).sum();
        self.check_range(offset, total)?;
        let fail = |e: NcclError| backend_error(&e);
        self.compute
            .context()
            .bind_to_thread()
            .map_err(|e| fail(cuda_err("cuCtxSetCurrent")(e)))?;
        let base = bucket_address(&self.bucket, &self.compute);
        let mut at = offset;
        for s in dst {
            if let Some(ptr) = s.ptr {
                // SAFETY: the source is inside the bucket (checked); the destination is the
                // caller's; the compute stream waits on the all-reduce (caller's contract).
                unsafe {
                    result::memcpy_dtod_async(
                        ptr,
                        base + (at * 4) as u64,
                        s.len * 4,
                        self.compute.cu_stream(),
                    )
                }
                .map_err(|e| fail(cuda_err("cuMemcpyDtoDAsync")(e)))?;
            }
            at += s.len;
        }
        Ok(())
    }

    fn read_to_host(&self, offset: usize, len: usize) -> Result<Vec<f32>, CollectiveError> {
        self.check_range(offset, len)?;
        self.order_compute()?;
        let view = self.bucket.slice(offset..offset + len);
        self.compute
            .clone_dtoh(&view)
            .and_then(|v| self.compute.synchronize().map(|()| v))
            .map_err(|e| backend_error(&cuda_err("cuMemcpyDtoH")(e)))
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for StagedLanding {
    fn drop(&mut self) {
        // The bucket is freed on the compute stream: order that after the all-reduce even
        // when no unit landed (an error path).
        let _ = self.pending.order_compute();
    }
}
