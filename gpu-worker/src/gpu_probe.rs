//! Probing CUDA and NCCL without ever panicking, and the choice of the intra-node collective.
//!
//! cudarc (0.19, dynamic loading) resolves every library and symbol with `expect`: a missing
//! `libcuda` or `libnccl`, or an older one than the compiled-in version, panics. Every cudarc
//! call here therefore runs inside [`std::panic::catch_unwind`] with the panic hook silenced,
//! so a probe prints nothing and returns a typed [`GpuProbeError`].
//!
//! cudarc opens NCCL by name (`libnccl.so`, `libnccl.so.12`, …) and never tries
//! `libnccl.so.2`, the only name pip's `nvidia-nccl-*` wheels ship. [`find_nccl`] searches the
//! usual places and, when only `libnccl.so.2` exists, links `libnccl.so` to it in a private
//! folder (`~/.cache/dreamddp/nccl-lib`). The dynamic loader reads `LD_LIBRARY_PATH` only when
//! a process starts, so that folder must be on it from the start:
//! [`GpuProbeError::NcclNotOnLoaderPath`] says so, and [`reexec_with_loader_path`] restarts the
//! current command with it prepended. When the process already has an NCCL mapped (libtorch's
//! CUDA library links one), that file is the one linked and opened ([`loaded_nccl`]): a second
//! NCCL in the same process breaks the communicators of both.
//!
//! Built without the `nccl` feature, [`probe_nccl`] returns [`GpuProbeError::NotBuilt`].

use std::path::{Path, PathBuf};

use thiserror::Error;

/// Environment variable naming a folder (or a file) holding `libnccl.so*`; searched first.
pub const NCCL_LIB_ENV: &str = "DREAMDDP_NCCL_LIB";
/// Set on a process that [`reexec_with_loader_path`] restarted, so it restarts only once.
pub const REEXEC_ENV: &str = "DREAMDDP_NCCL_REEXEC";

/// What a successful probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclInfo {
    /// CUDA devices the driver sees.
    pub devices: usize,
    /// NCCL's version code (`ncclGetVersion`, e.g. 22907 for 2.29.7).
    pub nccl_version: i32,
}

impl NcclInfo {
    /// The version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        let v = self.nccl_version;
        // NCCL ≥ 2.9 encodes major*10000 + minor*100 + patch.
        format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
    }
}

/// Why NCCL cannot be used on this machine (or by this binary).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum GpuProbeError {
    /// The binary was built without the `nccl` feature.
    #[error("this binary was built without NCCL support: rebuild with --features nccl")]
    NotBuilt,
    /// libcuda (the NVIDIA driver) is missing or does not initialize.
    #[error("no usable CUDA driver: {0}; NCCL needs the NVIDIA driver (libcuda.so.1) and a GPU")]
    NoCudaDriver(String),
    /// The driver loaded but sees no device.
    #[error("the CUDA driver sees no GPU ({0}); check nvidia-smi and CUDA_VISIBLE_DEVICES")]
    NoGpu(String),
    /// No NCCL library was found.
    #[error(
        "NCCL library (libnccl.so / libnccl.so.2) not found; searched {}; pip install nvidia-nccl-cu13 \
         (or nvidia-nccl-cu12) or install libnccl2, or point {NCCL_LIB_ENV} at its lib folder",
        show_paths(searched)
    )]
    NoNccl {
        /// The folders searched.
        searched: Vec<PathBuf>,
    },
    /// NCCL exists but not in a folder the dynamic loader searched when this process started.
    #[error(
        "NCCL found at {} but the loader cannot open it by name: run with \
         LD_LIBRARY_PATH={}:$LD_LIBRARY_PATH",
        library.display(),
        dir.display()
    )]
    NcclNotOnLoaderPath {
        /// The library file found.
        library: PathBuf,
        /// The folder holding `libnccl.so` (pointing at `library`) to put on the loader path.
        dir: PathBuf,
    },
    /// NCCL loaded but a call failed.
    #[error("NCCL loaded but failed: {0}")]
    NcclFailed(String),
    /// cudarc panicked during the probe (e.g. a symbol missing from an older driver or NCCL).
    #[error(
        "the CUDA/NCCL probe panicked (an older driver or NCCL than this build expects?): {0}"
    )]
    ProbePanicked(String),
}

fn show_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "no folders".into();
    }
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// An NCCL library found on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclLib {
    /// The library file (`…/libnccl.so` or `…/libnccl.so.2`).
    pub library: PathBuf,
    /// A folder holding a `libnccl.so` that opens `library` (its own folder, or the private
    /// symlink folder when only `libnccl.so.2` exists).
    pub loader_dir: PathBuf,
}

/// The NCCL library this process already has mapped (libtorch's CUDA library links one), read
/// from `/proc/self/maps`. NCCL must be that one: two NCCL copies in one process interpose
/// each other's exported calls (an all-reduce entering one copy checks the communicator with
/// the other's struct layout and fails with "corrupted comm object detected").
///
/// # Errors
/// [`GpuProbeError::NcclFailed`] when two different NCCL files are mapped already.
pub fn loaded_nccl() -> Result<Option<PathBuf>, GpuProbeError> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut files: Vec<PathBuf> = loaded_nccls_in(&maps)
        .into_iter()
        .map(|p| p.canonicalize().unwrap_or(p))
        .collect();
    files.dedup();
    match files.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one.clone())),
        several => Err(GpuProbeError::NcclFailed(format!(
            "this process has two NCCL libraries loaded ({}); they break each other's \
             communicators: keep one (the one libtorch links) on LD_LIBRARY_PATH",
            show_paths(several)
        ))),
    }
}

/// The NCCL files mapped in the text of a `/proc/<pid>/maps` file, in order, each once.
pub fn loaded_nccls_in(maps: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for p in maps
        .lines()
        .filter_map(|l| l.find('/').map(|i| Path::new(l[i..].trim_end())))
    {
        let nccl = p
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libnccl.so"));
        if nccl && !out.iter().any(|o| o == p) {
            out.push(p.to_path_buf());
        }
    }
    out
}

/// The file the dynamic loader opens for `libnccl.so` from `LD_LIBRARY_PATH` (the first
/// folder holding one), resolved; `None` when no folder there has one.
pub fn nccl_on_loader_path() -> Option<PathBuf> {
    let v = std::env::var_os("LD_LIBRARY_PATH")?;
    std::env::split_paths(&v)
        .map(|d| d.join("libnccl.so"))
        .find(|p| p.is_file())
        .and_then(|p| p.canonicalize().ok())
}

/// How `library` can be opened as `libnccl.so`: its own folder when that is its name,
/// otherwise a link in `link_dir`.
pub fn nccl_lib_for(library: &Path, link_dir: Option<&Path>) -> Result<NcclLib, GpuProbeError> {
    if library.file_name().is_some_and(|n| n == "libnccl.so") {
        if let Some(dir) = library.parent() {
            return Ok(NcclLib {
                library: library.to_path_buf(),
                loader_dir: dir.to_path_buf(),
            });
        }
    }
    let link_dir = link_dir.ok_or_else(|| {
        GpuProbeError::NcclFailed("no HOME for the libnccl.so link folder".into())
    })?;
    link_nccl(library, link_dir).map_err(|e| {
        GpuProbeError::NcclFailed(format!(
            "cannot link {}/libnccl.so to {}: {e}",
            link_dir.display(),
            library.display()
        ))
    })?;
    Ok(NcclLib {
        library: library.to_path_buf(),
        loader_dir: link_dir.to_path_buf(),
    })
}

/// The private folder for the `libnccl.so` symlink.
pub fn nccl_link_dir() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/dreamddp/nccl-lib"))
}

/// The folders searched for NCCL, in order: `$DREAMDDP_NCCL_LIB`, `$LD_LIBRARY_PATH`, the
/// torch venv's `site-packages/nvidia/*/lib` (bench/install_torch.sh), the system library
/// folders.
pub fn nccl_search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(v) = std::env::var_os(NCCL_LIB_ENV) {
        let p = PathBuf::from(v);
        dirs.push(if p.is_file() {
            p.parent().map(Path::to_path_buf).unwrap_or(p)
        } else {
            p
        });
    }
    if let Some(v) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
    }
    if let Some(home) = std::env::var_os("HOME") {
        let nvidia = PathBuf::from(home)
            .join(".cache/dreamddp/torch/venv-2.13.0/lib/python3.11/site-packages/nvidia");
        if let Ok(rd) = std::fs::read_dir(&nvidia) {
            let mut found: Vec<PathBuf> = rd
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("lib"))
                .filter(|p| p.is_dir())
                .collect();
            found.sort();
            dirs.extend(found);
        }
    }
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let mut seen = std::collections::BTreeSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// Finds NCCL in [`nccl_search_dirs`]; when a folder has only `libnccl.so.2`, links
/// `libnccl.so` to it in [`nccl_link_dir`].
pub fn find_nccl() -> Result<NcclLib, GpuProbeError> {
    find_nccl_in(&nccl_search_dirs(), nccl_link_dir().as_deref())
}

/// [`find_nccl`] over explicit folders and symlink folder (for tests).
pub fn find_nccl_in(dirs: &[PathBuf], link_dir: Option<&Path>) -> Result<NcclLib, GpuProbeError> {
    for d in dirs {
        let plain = d.join("libnccl.so");
        if plain.is_file() {
            return Ok(NcclLib {
                library: plain,
                loader_dir: d.clone(),
            });
        }
    }
    for d in dirs {
        let versioned = d.join("libnccl.so.2");
        if !versioned.is_file() {
            continue;
        }
        let Some(link_dir) = link_dir else {
            continue;
        };
        if link_nccl(&versioned, link_dir).is_ok() {
            return Ok(NcclLib {
                library: versioned,
                loader_dir: link_dir.to_path_buf(),
            });
        }
    }
    Err(GpuProbeError::NoNccl {
        searched: dirs.to_vec(),
    })
}

/// Makes `link_dir/libnccl.so` point at `target` (replacing a stale link).
fn link_nccl(target: &Path, link_dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(link_dir)?;
    let link = link_dir.join("libnccl.so");
    if std::fs::read_link(&link).ok().as_deref() == Some(target) && link.is_file() {
        return Ok(());
    }
    let tmp = link_dir.join(format!(".libnccl.so.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    std::fs::rename(&tmp, &link)
}

/// Whether `dir` was on `LD_LIBRARY_PATH` (as this process sees it).
pub fn on_loader_path(dir: &Path) -> bool {
    std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).any(|p| p == dir))
        .unwrap_or(false)
}

/// Restarts the current process (same arguments) with `dir` prepended to `LD_LIBRARY_PATH`,
/// so cudarc can open `libnccl.so` by name. Returns only on failure, or when this process was
/// already restarted once ([`REEXEC_ENV`]).
pub fn reexec_with_loader_path(dir: &Path) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    if std::env::var_os(REEXEC_ENV).is_some() {
        return std::io::Error::other(format!(
            "already restarted once with {} on LD_LIBRARY_PATH and NCCL still does not load",
            dir.display()
        ));
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return e,
    };
    let mut path = vec![dir.to_path_buf()];
    if let Some(v) = std::env::var_os("LD_LIBRARY_PATH") {
        path.extend(std::env::split_paths(&v));
    }
    let joined = match std::env::join_paths(path) {
        Ok(j) => j,
        Err(e) => return std::io::Error::other(e.to_string()),
    };
    std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", joined)
        .env(REEXEC_ENV, "1")
        .exec()
}

/// Held while the process-wide panic hook is swapped ([`quiet_catch`]; tests that install
/// their own hook).
static HOOK_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f` with the panic hook silenced and turns a panic into
/// [`GpuProbeError::ProbePanicked`]. Probes are serialized (the hook is process-wide).
pub fn quiet_catch<T>(f: impl FnOnce() -> T) -> Result<T, GpuProbeError> {
    let _guard = HOOK_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(previous);
    r.map_err(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".into());
        GpuProbeError::ProbePanicked(msg)
    })
}

/// Checks, in order, libcuda, the device count and NCCL; never panics and prints nothing.
pub fn probe_nccl() -> Result<NcclInfo, GpuProbeError> {
    #[cfg(feature = "nccl")]
    {
        quiet_catch(probe_nccl_inner)?
    }
    #[cfg(not(feature = "nccl"))]
    {
        Err(GpuProbeError::NotBuilt)
    }
}

#[cfg(feature = "nccl")]
fn probe_nccl_inner() -> Result<NcclInfo, GpuProbeError> {
    use cudarc::driver::{result as cu, sys as cusys};
    // SAFETY: only tries to open the library (libloading); no symbol is called.
    if !unsafe { cusys::is_culib_present() } {
        return Err(GpuProbeError::NoCudaDriver(
            "libcuda.so not found by the dynamic loader".into(),
        ));
    }
    if let Err(e) = cu::init() {
        let text = format!("{e:?}");
        return Err(if text.contains("NO_DEVICE") {
            GpuProbeError::NoGpu(format!("cuInit: {text}"))
        } else {
            GpuProbeError::NoCudaDriver(format!("cuInit failed: {text}"))
        });
    }
    let devices = cu::device::get_count()
        .map_err(|e| GpuProbeError::NoCudaDriver(format!("cuDeviceGetCount failed: {e:?}")))?;
    if devices <= 0 {
        return Err(GpuProbeError::NoGpu("cuDeviceGetCount = 0".into()));
    }
    // One NCCL per process: when one is already mapped (libtorch's), cudarc must open that
    // file, so `libnccl.so` on the loader path must be it (else restart with a link to it).
    if let Some(loaded) = loaded_nccl()? {
        let same = nccl_on_loader_path()
            .zip(loaded.canonicalize().ok())
            .is_some_and(|(on_path, loaded)| on_path == loaded);
        if !same {
            let lib = nccl_lib_for(&loaded, nccl_link_dir().as_deref())?;
            return Err(GpuProbeError::NcclNotOnLoaderPath {
                library: lib.library,
                dir: lib.loader_dir,
            });
        }
    }
    // SAFETY: only tries to open the library by cudarc's names.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        let lib = find_nccl()?;
        return Err(GpuProbeError::NcclNotOnLoaderPath {
            library: lib.library,
            dir: lib.loader_dir,
        });
    }
    let nccl_version = cudarc::nccl::result::get_nccl_version()
        .map_err(|e| GpuProbeError::NcclFailed(format!("ncclGetVersion: {e:?}")))?;
    Ok(NcclInfo {
        devices: devices as usize,
        nccl_version,
    })
}

/// What `--collective` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CollectiveRequest {
    /// The thread collective over host memory.
    Cpu,
    /// NCCL, or stop.
    Nccl,
    /// NCCL when the device is CUDA and NCCL works, otherwise the CPU collective.
    #[default]
    Auto,
}

impl std::str::FromStr for CollectiveRequest {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "nccl" => Ok(Self::Nccl),
            "auto" => Ok(Self::Auto),
            o => Err(format!(
                "unknown --collective '{o}'; expected cpu|nccl|auto"
            )),
        }
    }
}

/// The collective a run uses, resolved from a [`CollectiveRequest`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CollectiveChoice {
    /// [`node::thread_collective::ThreadCollective`].
    #[default]
    Cpu,
    /// [`crate::nccl::NcclCollective`]: NCCL over the node's GPUs, one worker per GPU.
    Nccl,
}

impl std::fmt::Display for CollectiveChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Cpu => "cpu (thread all-reduce over host memory)",
            Self::Nccl => "nccl (one rank per GPU)",
        })
    }
}

/// Whether this build has the NCCL all-reduce (feature `nccl`).
pub const NCCL_COLLECTIVE_IMPLEMENTED: bool = cfg!(feature = "nccl");

/// Why `--collective` could not be honored.
#[derive(Debug, Error)]
pub enum CollectiveSelectError {
    /// `--collective nccl` and NCCL is unusable.
    #[error("--collective nccl: {0}")]
    Unusable(GpuProbeError),
    /// `--collective nccl` with more workers than GPUs (NCCL puts one rank on a device).
    #[error(
        "--collective nccl: NCCL puts one rank on a GPU, and {ranks} workers were asked for with \
         {devices} GPU(s) visible; use --workers {devices} (or fewer), or --collective cpu"
    )]
    TooFewDevices {
        /// Workers asked for.
        ranks: usize,
        /// GPUs visible.
        devices: usize,
    },
}

/// Resolves `request` for a run of `ranks` workers whose backend device is `cuda` (true for
/// `--device cuda…`), with `probe` standing in for [`probe_nccl`]. `auto` picks NCCL when the
/// device is CUDA, NCCL works and there is a GPU per worker, and otherwise the CPU collective, with a `[WARN]` when GPUs were asked for and NCCL is unusable.
pub fn select_collective(
    request: CollectiveRequest,
    cuda: bool,
    ranks: usize,
    probe: impl FnOnce() -> Result<NcclInfo, GpuProbeError>,
) -> Result<CollectiveChoice, CollectiveSelectError> {
    match request {
        CollectiveRequest::Cpu => Ok(CollectiveChoice::Cpu),
        CollectiveRequest::Nccl => {
            let info = probe().map_err(CollectiveSelectError::Unusable)?;
            if !NCCL_COLLECTIVE_IMPLEMENTED {
                // A probe that succeeds was built with the feature; keep the rule total.
                return Err(CollectiveSelectError::Unusable(GpuProbeError::NotBuilt));
            }
            if ranks > info.devices {
                return Err(CollectiveSelectError::TooFewDevices {
                    ranks,
                    devices: info.devices,
                });
            }
            Ok(CollectiveChoice::Nccl)
        }
        CollectiveRequest::Auto if !cuda => Ok(CollectiveChoice::Cpu),
        CollectiveRequest::Auto => match probe() {
            Ok(info) if NCCL_COLLECTIVE_IMPLEMENTED && ranks <= info.devices => {
                tracing::info!(
                    "NCCL {} with {} GPU(s): auto picks the NCCL collective",
                    info.version_string(),
                    info.devices
                );
                Ok(CollectiveChoice::Nccl)
            }
            Ok(info) => {
                tracing::warn!(
                    "[WARN] NCCL {} sees {} GPU(s) for {ranks} workers (NCCL needs one GPU per \
                     worker); using the CPU collective",
                    info.version_string(),
                    info.devices
                );
                Ok(CollectiveChoice::Cpu)
            }
            Err(e) => {
                tracing::warn!(
                    "[WARN] GPUs asked for but NCCL is unusable ({e}); using the CPU collective"
                );
                Ok(CollectiveChoice::Cpu)
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nccl_a_process_has_mapped_is_found_in_its_maps() {
        let maps = "\
7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f20-7f30 r--p 00000000 08:01 2 /venv/site-packages/nvidia/nccl/lib/libnccl.so.2
7f40-7f50 rw-p 00000000 00:00 0 [heap]
7f60-7f70 r-xp 00000000 08:01 3 /opt/my libs/libnccl.so
";
        assert_eq!(
            loaded_nccls_in(maps),
            vec![
                PathBuf::from("/venv/site-packages/nvidia/nccl/lib/libnccl.so.2"),
                PathBuf::from("/opt/my libs/libnccl.so")
            ]
        );
        assert_eq!(
            loaded_nccls_in(
                "7f60-7f70 r-xp 0 08:01 3 /a/libnccl.so\n7f70-7f80 r--p 0 08:01 3 /a/libnccl.so\n"
            ),
            vec![PathBuf::from("/a/libnccl.so")]
        );
        assert!(loaded_nccls_in("7f40-7f50 rw-p 00000000 00:00 0 [heap]\n").is_empty());
        // This test process links no NCCL.
        assert_eq!(loaded_nccl(), Ok(None));
    }

    #[test]
    fn a_loaded_nccl_is_opened_through_its_own_folder_or_a_link() {
        let dir = std::env::temp_dir().join(format!("ddp-loaded-nccl-{}", std::process::id()));
        let libs = dir.join("lib");
        std::fs::create_dir_all(&libs).unwrap();
        let versioned = libs.join("libnccl.so.2");
        std::fs::write(&versioned, b"not really a library").unwrap();
        let link_dir = dir.join("link");
        let lib = nccl_lib_for(&versioned, Some(&link_dir)).unwrap();
        assert_eq!(lib.loader_dir, link_dir);
        assert_eq!(
            link_dir.join("libnccl.so").canonicalize().unwrap(),
            versioned.canonicalize().unwrap()
        );
        let plain = libs.join("libnccl.so");
        std::fs::write(&plain, b"x").unwrap();
        assert_eq!(nccl_lib_for(&plain, None).unwrap().loader_dir, libs);
        assert!(matches!(
            nccl_lib_for(&versioned, None),
            Err(GpuProbeError::NcclFailed(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn probe_errors_without_panicking_or_printing() {
        // Installs a hook that records any call: the probe must not reach it.
        static CALLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let r = probe_nccl();
        let err = r.expect_err("no GPU on the machines this runs on in CI");
        if cfg!(feature = "nccl") {
            // This machine: no libcuda at all (a GPU machine would pass the driver step).
            if std::path::Path::new("/proc/driver/nvidia").exists() {
                assert!(!matches!(err, GpuProbeError::NotBuilt), "{err}");
            } else {
                assert!(matches!(err, GpuProbeError::NoCudaDriver(_)), "{err}");
            }
        } else {
            assert_eq!(err, GpuProbeError::NotBuilt);
        }
        // The probe restores the hook: a panic after it reaches ours. The hook is swapped
        // under the probes' lock, so no probe of a concurrent test is midway through its own
        // swap (it would restore the hook it took, not ours).
        let me = std::thread::current().id();
        let previous = {
            let _guard = HOOK_LOCK.lock().unwrap_or_else(|p| p.into_inner());
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |_| {
                if std::thread::current().id() == me {
                    CALLED.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }));
            previous
        };
        let _ = probe_nccl();
        assert!(
            !CALLED.load(std::sync::atomic::Ordering::SeqCst),
            "the probe reached the hook"
        );
        {
            let _guard = HOOK_LOCK.lock().unwrap_or_else(|p| p.into_inner());
            let _ = std::panic::catch_unwind(|| panic!("after"));
            std::panic::set_hook(previous);
        }
        assert!(
            CALLED.load(std::sync::atomic::Ordering::SeqCst),
            "hook not restored"
        );
    }

    #[test]
    fn quiet_catch_turns_a_panic_into_an_error() {
        let e = quiet_catch(|| -> u32 { panic!("Missing symbol ncclFoo") }).unwrap_err();
        assert_eq!(
            e,
            GpuProbeError::ProbePanicked("Missing symbol ncclFoo".into())
        );
        let e = quiet_catch(|| -> u32 { panic!("{}", String::from("owned")) }).unwrap_err();
        assert_eq!(e, GpuProbeError::ProbePanicked("owned".into()));
        assert_eq!(quiet_catch(|| 7).unwrap(), 7);
    }

    #[test]
    fn finds_libnccl_so_2_and_links_it() {
        let tmp = std::env::temp_dir().join(format!("dreamddp-nccl-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let lib = tmp.join("site/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnccl.so.2"), b"not really").unwrap();
        let links = tmp.join("links");
        let empty = tmp.join("empty");
        let found = find_nccl_in(&[empty.clone(), lib.clone()], Some(&links)).unwrap();
        assert_eq!(found.library, lib.join("libnccl.so.2"));
        assert_eq!(found.loader_dir, links);
        assert_eq!(
            std::fs::read_link(links.join("libnccl.so")).unwrap(),
            lib.join("libnccl.so.2")
        );
        // Twice is fine (the link is kept).
        assert_eq!(
            find_nccl_in(std::slice::from_ref(&lib), Some(&links)).unwrap(),
            found
        );
        // A plain libnccl.so wins and needs no link.
        std::fs::create_dir_all(&empty).unwrap();
        std::fs::write(empty.join("libnccl.so"), b"x").unwrap();
        let plain = find_nccl_in(&[lib.clone(), empty.clone()], Some(&links)).unwrap();
        assert_eq!(plain.loader_dir, empty);
        // Nothing: the error lists the folders and says what to install.
        let none = find_nccl_in(&[tmp.join("nowhere")], Some(&links)).unwrap_err();
        let text = none.to_string();
        assert!(
            text.contains("nowhere") && text.contains("pip install nvidia-nccl-cu13"),
            "{text}"
        );
        assert!(text.contains("libnccl2"), "{text}");
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn finds_the_torch_venv_nccl_when_installed() {
        let Some(home) = std::env::var_os("HOME") else {
            return;
        };
        let venv = PathBuf::from(home)
            .join(".cache/dreamddp/torch/venv-2.13.0/lib/python3.11/site-packages/nvidia");
        let has = std::fs::read_dir(&venv)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .any(|e| e.path().join("lib/libnccl.so.2").is_file())
            })
            .unwrap_or(false);
        if !has {
            eprintln!("no torch venv NCCL at {}; skipped", venv.display());
            return;
        }
        let lib = find_nccl().expect("the venv ships libnccl.so.2");
        assert!(lib.loader_dir.join("libnccl.so").is_file(), "{lib:?}");
    }

    #[test]
    fn requests_parse_and_resolve() {
        assert_eq!(
            "auto".parse::<CollectiveRequest>().unwrap(),
            CollectiveRequest::Auto
        );
        let bad = "bogus".parse::<CollectiveRequest>().unwrap_err();
        assert!(bad.contains("cpu|nccl|auto"), "{bad}");
        let ok = || {
            Ok(NcclInfo {
                devices: 2,
                nccl_version: 22907,
            })
        };
        let missing = || Err(GpuProbeError::NoCudaDriver("none".into()));
        assert_eq!(
            select_collective(CollectiveRequest::Cpu, true, 1, ok).unwrap(),
            CollectiveChoice::Cpu
        );
        assert_eq!(
            select_collective(
                CollectiveRequest::Auto,
                false,
                1,
                || -> Result<NcclInfo, _> { panic!("auto on a CPU device must not probe") }
            )
            .unwrap(),
            CollectiveChoice::Cpu
        );
        assert_eq!(
            select_collective(CollectiveRequest::Auto, true, 1, missing).unwrap(),
            CollectiveChoice::Cpu
        );
        let e = select_collective(CollectiveRequest::Nccl, false, 1, missing).unwrap_err();
        assert!(e.to_string().contains("CUDA driver"), "{e}");
        // NCCL works: nccl runs it with a GPU per worker, and refuses more workers than GPUs;
        // a build without the collective says how to get it.
        if NCCL_COLLECTIVE_IMPLEMENTED {
            assert_eq!(
                select_collective(CollectiveRequest::Nccl, true, 2, ok).unwrap(),
                CollectiveChoice::Nccl
            );
            let e = select_collective(CollectiveRequest::Nccl, true, 3, ok).unwrap_err();
            assert!(
                e.to_string().contains("--workers 2") && e.to_string().contains("3 workers"),
                "{e}"
            );
        } else {
            let e = select_collective(CollectiveRequest::Nccl, true, 2, ok).unwrap_err();
            assert!(e.to_string().contains("--features nccl"), "{e}");
        }
        // auto takes NCCL only with a GPU per worker.
        let with_gpu_per_worker = if NCCL_COLLECTIVE_IMPLEMENTED {
            CollectiveChoice::Nccl
        } else {
            CollectiveChoice::Cpu
        };
        assert_eq!(
            select_collective(CollectiveRequest::Auto, true, 2, ok).unwrap(),
            with_gpu_per_worker
        );
        assert_eq!(
            select_collective(CollectiveRequest::Auto, true, 4, ok).unwrap(),
            CollectiveChoice::Cpu
        );
    }
}
