//! The NCCL collective (feature `nccl`): in-place all-reduce of device buffers on a
//! communication stream ([`device`]), the [`node::collective::Collective`] backend built on
//! it for workers whose values live on the host ([`host`]), and the trainer's device path for
//! units whose tensors live on the rank's GPU ([`staged`]).
//!
//! Every cudarc call that can reach a missing library runs after [`crate::gpu_probe`] said
//! the libraries are there, and inside [`crate::gpu_probe::quiet_catch`] where cudarc could
//! still panic (symbol lookups happen on first use), so a broken installation is a typed
//! [`NcclError`], never a panic.

pub mod device;
pub mod host;
pub mod staged;

use thiserror::Error;

pub use device::{DeviceBuffer, NcclRank, PendingDeviceReduce, ReduceTiming, ReductionOp};
pub use host::NcclCollective;

/// What went wrong setting up or running NCCL.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum NcclError {
    /// The probe (libcuda, a GPU, libnccl) failed.
    #[error(transparent)]
    Probe(#[from] crate::gpu_probe::GpuProbeError),
    /// More ranks than GPUs: NCCL puts at most one rank of a communicator on a device.
    #[error(
        "NCCL needs one GPU per rank: {ranks} rank(s) asked for, {devices} GPU(s) visible; use \
         --workers {devices} (or fewer) with --collective nccl, or --collective cpu"
    )]
    TooFewDevices {
        /// Ranks asked for.
        ranks: usize,
        /// Devices the driver sees.
        devices: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {message}")]
    Cuda {
        /// The call.
        call: &'static str,
        /// The driver's error.
        message: String,
    },
    /// An NCCL call failed.
    #[error("NCCL {call} failed: {message}")]
    Nccl {
        /// The call.
        call: &'static str,
        /// NCCL's error.
        message: String,
    },
}

pub(crate) fn cuda_err(
    call: &'static str,
) -> impl FnOnce(cudarc::driver::DriverError) -> NcclError {
    move |e| NcclError::Cuda {
        call,
        message: format!("{e:?}"),
    }
}

pub(crate) fn nccl_err(
    call: &'static str,
) -> impl FnOnce(cudarc::nccl::result::NcclError) -> NcclError {
    move |e| NcclError::Nccl {
        call,
        message: describe_nccl(e.0, std::ptr::null_mut()),
    }
}

/// NCCL's name and text for `code`, and the communicator's last error when there is one.
pub(crate) fn describe_nccl(
    code: cudarc::nccl::sys::ncclResult_t,
    comm: cudarc::nccl::sys::ncclComm_t,
) -> String {
    use cudarc::nccl::sys;
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: NCCL returns NUL-terminated static or per-communicator strings.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        }
    };
    // SAFETY: both calls only read NCCL's error tables; a null comm is allowed for the first.
    let what = crate::gpu_probe::quiet_catch(|| text(unsafe { sys::ncclGetErrorString(code) }))
        .unwrap_or_default();
    let last = if comm.is_null() {
        String::new()
    } else {
        crate::gpu_probe::quiet_catch(|| text(unsafe { sys::ncclGetLastError(comm) }))
            .unwrap_or_default()
    };
    let mut s = format!("{code:?}");
    if !what.is_empty() {
        s.push_str(&format!(" ({what})"));
    }
    if !last.is_empty() {
        s.push_str(&format!(": {last}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use node::collective::Collective;

    /// On a machine without the NVIDIA driver every entry point returns the probe's typed
    /// error (no panic); on a GPU machine the world of one rank all-reduces to itself.
    #[test]
    fn without_a_gpu_every_entry_point_is_a_typed_error() {
        let no_driver = !std::path::Path::new("/proc/driver/nvidia").exists();
        match NcclCollective::new(1) {
            Err(NcclError::Probe(e)) => assert!(no_driver, "probe failed on a GPU machine: {e}"),
            Err(e) => assert!(!no_driver, "unexpected error without a driver: {e}"),
            Ok(c) => {
                assert!(!no_driver);
                let h = c
                    .all_reduce_mean(0, node::collective::ReduceKey::new(0, 0), vec![1.0, 2.5])
                    .expect("submit");
                assert_eq!(h.wait().expect("wait"), vec![1.0, 2.5]);
            }
        }
        if no_driver {
            for r in [
                NcclRank::init_all(&[0]).map(|_| ()),
                NcclRank::unique_id().map(|_| ()),
                NcclRank::from_rank(0, 0, 1, &[0; 128]).map(|_| ()),
            ] {
                let e = r.expect_err("no driver");
                assert!(matches!(e, NcclError::Probe(_)), "{e}");
                assert!(e.to_string().contains("CUDA"), "{e}");
            }
        }
        let e = NcclError::TooFewDevices {
            ranks: 4,
            devices: 1,
        };
        assert!(e.to_string().contains("--workers 1"), "{e}");
    }
}
