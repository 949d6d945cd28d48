//! Softmax cross-entropy loss (mean over rows) and accuracy helpers.
