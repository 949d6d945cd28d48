//! Buckets: adjacent small layers with the same schedule packed together, large layers alone.
