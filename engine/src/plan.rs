//! Sync plans: strategies, per-layer periods, which layers are due at a step.
