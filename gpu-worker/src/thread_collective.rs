//! Collective among the worker threads of one process (CPU-only nodes), shaped by a link model.
