//! The layer zoo of the built-in CPU backend. Every layer has a finite-difference gradient test.

pub mod activation;
pub mod attention;
pub mod block;
pub mod conv;
pub mod embedding;
pub mod flatten;
pub mod layernorm;
pub mod linear;
pub mod pool;
