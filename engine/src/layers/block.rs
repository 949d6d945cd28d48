//! Pre-LayerNorm transformer block (attention + MLP, both residual) as one layer.
