//! Finds the shared data sets folder (../shared/data/datasets) from the working directory.
//!
//! Order: the `DREAMDDP_DATA_DIR` environment variable (`none`: no shared folder at all), then `../shared/data/datasets` and
//! `../../shared/data/datasets` relative to the current directory, to this crate's manifest
//! directory and to its parent (the workspace root). The first candidate that is an existing
//! directory wins; tests use `None` to skip cleanly on machines without the shared folder.

use std::path::{Path, PathBuf};

/// Environment variable that overrides where the shared data sets live.
pub const DATA_DIR_ENV: &str = "DREAMDDP_DATA_DIR";

/// `DREAMDDP_DATA_DIR=none`: behave as on a machine without the shared folder (embedded
/// digits, the traces shipped in `simulations/traces/`), e.g. to check a fresh clone.
pub const NO_SHARED: &str = "none";

/// The shared data sets folder, or `None` when no candidate exists.
pub fn shared_datasets_dir() -> Option<PathBuf> {
    let from_env = std::env::var_os(DATA_DIR_ENV).map(PathBuf::from);
    if from_env.as_deref() == Some(Path::new(NO_SHARED)) {
        return None;
    }
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut bases = Vec::with_capacity(3);
    if let Ok(current) = std::env::current_dir() {
        bases.push(current);
    }
    bases.push(manifest_dir.to_path_buf());
    if let Some(workspace) = manifest_dir.parent() {
        bases.push(workspace.to_path_buf());
    }
    first_existing(candidates(from_env, &bases))
}

/// The MNIST folder inside the shared data sets folder, when it exists.
pub fn shared_mnist_dir() -> Option<PathBuf> {
    shared_datasets_dir()
        .map(|dir| dir.join("mnist"))
        .filter(|dir| dir.is_dir())
}

/// The tinyshakespeare text inside the shared data sets folder, when it exists.
pub fn shared_tinyshakespeare_path() -> Option<PathBuf> {
    shared_datasets_dir()
        .map(|dir| dir.join("tinyshakespeare").join("input.txt"))
        .filter(|path| path.is_file())
}

/// Candidate folders in priority order: `from_env`, then `../shared/data/datasets` and
/// `../../shared/data/datasets` under each base.
fn candidates(from_env: Option<PathBuf>, bases: &[PathBuf]) -> Vec<PathBuf> {
    let relative = Path::new("shared").join("data").join("datasets");
    let mut out: Vec<PathBuf> = from_env.into_iter().collect();
    for base in bases {
        out.push(base.join("..").join(&relative));
        out.push(base.join("..").join("..").join(&relative));
    }
    out
}

fn first_existing(candidates: Vec<PathBuf>) -> Option<PathBuf> {
    candidates.into_iter().find(|path| path.is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_override_wins_and_order_is_parent_then_grandparent() {
        let list = candidates(Some(PathBuf::from("/env/dir")), &[PathBuf::from("/a/b")]);
        assert_eq!(
            list,
            vec![
                PathBuf::from("/env/dir"),
                PathBuf::from("/a/b/../shared/data/datasets"),
                PathBuf::from("/a/b/../../shared/data/datasets"),
            ]
        );
    }

    #[test]
    fn first_existing_skips_missing_folders() {
        let existing = std::env::temp_dir();
        let missing = existing.join("dreamddp-surely-missing-folder-7f3a");
        assert_eq!(
            first_existing(vec![missing.clone(), existing.clone()]),
            Some(existing)
        );
        assert_eq!(first_existing(vec![missing]), None);
    }
}
