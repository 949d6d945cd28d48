//! Devices: parsing `cpu`/`cuda`/`cuda:N`, loading libtorch's CUDA library at run time, and
//! checking that libtorch can use the device.

use tch::{Cuda, Device};

use crate::{parse_device_spec, DeviceSpec, TchBackendError};

pub(super) fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(n) => format!("cuda:{n}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Parses `cpu`, `cuda` or `cuda:N` and checks that libtorch can use the device.
///
/// # Errors
/// [`TchBackendError::UnknownDevice`] for other strings; [`TchBackendError::CudaUnavailable`]
/// when libtorch sees no CUDA device (CPU-only libtorch, no driver, no GPU) or fewer than N+1.
pub fn parse_device(s: &str) -> Result<Device, TchBackendError> {
    match parse_device_spec(s)? {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(n) => {
            if let Err(why) = load_torch_cuda() {
                return Err(TchBackendError::CudaUnavailable {
                    device: s.to_string(),
                    reason: format!("libtorch's CUDA library could not be loaded ({why})"),
                });
            }
            if !Cuda::is_available() {
                return Err(TchBackendError::CudaUnavailable {
                    device: s.to_string(),
                    reason: "libtorch sees no CUDA device (no NVIDIA GPU or driver visible, or a \
                             CPU-only libtorch)"
                        .to_string(),
                });
            }
            let count = Cuda::device_count();
            if i64::try_from(n).map_or(true, |n| n >= count) {
                return Err(TchBackendError::CudaUnavailable {
                    device: s.to_string(),
                    reason: format!("libtorch sees {count} CUDA device(s), so no cuda:{n}"),
                });
            }
            Ok(Device::Cuda(n))
        }
    }
}

/// The linker drops `libtorch_cuda.so` (`--as-needed`: no symbol of it is referenced), and
/// without it libtorch has no CUDA backend. Loading it at run time (once, `RTLD_GLOBAL`)
/// registers the backend in every binary, whatever its link flags. It also maps the NCCL
/// libtorch links, which the NCCL probe must find before it picks a library (one NCCL per
/// process): callers about to probe NCCL load it first.
///
/// # Errors
/// The loader's message for every name tried (a CPU-only torch has no `libtorch_cuda.so`).
pub fn load_torch_cuda() -> Result<(), String> {
    use std::ffi::{c_char, c_int, c_void, CStr, CString};
    use std::sync::OnceLock;

    unsafe extern "C" {
        fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
        fn dlerror() -> *mut c_char;
    }
    const RTLD_NOW: c_int = 2;
    const RTLD_GLOBAL: c_int = 0x100;
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let mut errors = Vec::new();
            let built_with =
                option_env!("DREAMDDP_LIBTORCH_LIB").map(|lib| format!("{lib}/libtorch_cuda.so"));
            for name in built_with
                .into_iter()
                .chain(["libtorch_cuda.so".to_string()])
            {
                let Ok(c_name) = CString::new(name.clone()) else {
                    continue;
                };
                // SAFETY: `c_name` is a valid NUL-terminated string; dlopen/dlerror are the C
                // library's, and the handle is deliberately never closed.
                let handle = unsafe { dlopen(c_name.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
                if !handle.is_null() {
                    return Ok(());
                }
                // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next
                // dl* call on this thread; it is copied at once.
                let why = unsafe {
                    let e = dlerror();
                    if e.is_null() {
                        "unknown error".to_string()
                    } else {
                        CStr::from_ptr(e).to_string_lossy().into_owned()
                    }
                };
                errors.push(format!("{name}: {why}"));
            }
            Err(errors.join("; "))
        })
        .clone()
}

/// Like [`parse_device`], for callers that only need to know the device is usable.
///
/// # Errors
/// See [`parse_device`].
pub fn check_device(s: &str) -> Result<(), TchBackendError> {
    parse_device(s).map(|_| ())
}

/// One libtorch intra-op pool shared by every replica of the process, sized like the
/// built-in engine's GEMMs (`engine::backend::threads`, default 1: each worker thread owns a
/// core). libtorch's default (one thread per core in every worker) oversubscribes the cores:
/// 4 workers on 2 cores ran 2.4x slower per step than the built-in engine.
pub(super) fn configure_threads(device: Device) {
    if device == Device::Cpu {
        tch::set_num_threads(engine::backend::threads() as i32);
    }
}
