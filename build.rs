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
    let lib = format!("{libtorch}/lib");
    // `--no-as-needed` keeps libtorch_cuda.so in the binary's NEEDED list even though no
    // symbol of it is referenced directly; without it CUDA is never registered at run time.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-L{lib}");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
