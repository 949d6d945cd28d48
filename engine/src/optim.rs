//! Per-layer optimizers: SGD with momentum and AdamW.
