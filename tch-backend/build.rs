//! With feature `tch`: an rpath to libtorch's `lib` folder for this package's own binaries
//! (its tests), so they run without LD_LIBRARY_PATH. Binaries of other packages need the
//! same `-Wl,-rpath,<LIBTORCH>/lib` from their own build script (cargo applies
//! `rustc-link-arg` only to the package that prints it); `DEP_`-style metadata needs a
//! `links` key, which this crate cannot claim (torch-sys links `torch`).

/// Where bench/install_torch.sh puts PyTorch 2.13 (its `torch` folder is a libtorch).
const DEFAULT_LIBTORCH: &str =
    "/root/.cache/dreamddp/torch/venv-2.13.0/lib/python3.11/site-packages/torch";

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_TCH").is_none() {
        return;
    }
    let libtorch = std::env::var("LIBTORCH").unwrap_or_else(|_| DEFAULT_LIBTORCH.to_string());
    let lib = format!("{}/lib", libtorch.trim_end_matches('/'));
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    println!("cargo:rustc-env=DREAMDDP_LIBTORCH_LIB={lib}");
}
