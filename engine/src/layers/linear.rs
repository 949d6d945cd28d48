//! Fully connected layer (y = x·Wᵀ + b over the last dimension).
