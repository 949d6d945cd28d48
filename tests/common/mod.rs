//! Helpers shared by the end-to-end tests: run the real `dreamddp` binary, scratch folders.

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs the `dreamddp` binary with `args` (quiet logs) and returns its output.
pub fn dreamddp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dreamddp"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("the dreamddp binary starts")
}

/// A fresh, empty scratch folder unique to this test process and `name`.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dreamddp-e2e-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Standard output and error of a run, together.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
