//! The 8x8 digits CSV (scikit-learn layout), embedded in the binary as the default data set.
