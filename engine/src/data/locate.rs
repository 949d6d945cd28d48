//! Finds the shared data sets folder (../shared/data/datasets) from the working directory.
