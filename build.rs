//! Build script of the `dreamddp` binary: with feature `tch`, bake libtorch's library folder
//! into the binary's run path so it runs without `LD_LIBRARY_PATH` (torch-sys links libtorch
//! dynamically but sets no rpath on downstream binaries). The folder is `$LIBTORCH/lib`, or,
//! as torch-sys finds it, the venv `bench/install_torch.sh` makes.

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_TCH").is_none() {
        return;
    }
    let libtorch = std::env::var("LIBTORCH").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_default();
        format!("{home}/.cache/dreamddp/torch/venv-2.13.0/lib/python3.11/site-packages/torch")
    });
    // libtorch_cuda.so is not linked (nothing references it, so the linker drops it): the tch
    // backend loads it at run time when a CUDA device is asked for, so a machine without the
    // CUDA libraries still runs the CPU paths.
    let lib = format!("{libtorch}/lib");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
}
