//! Causal multi-head self-attention.
