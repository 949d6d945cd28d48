//! MNIST IDX (.gz or raw) loader.
