//! Flatten: reshapes [N, ...] to [N, prod(...)] (no parameters).
