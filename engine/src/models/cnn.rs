//! The `cnn` model for MNIST (two conv + max-pool stages, then linear layers).
