//! Data sets: MNIST IDX, the digits CSV, a character corpus, and the sharded sampler.

pub mod corpus;
pub mod digits;
pub mod locate;
pub mod mnist;
pub mod sampler;
