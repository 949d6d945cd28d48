//! The intra-node collective trait: asynchronous all-reduce of a bucket, with a handle the optimizer waits on.
