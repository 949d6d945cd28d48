//! 2-D max pooling (NCHW).
