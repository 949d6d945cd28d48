//! 2-D convolution (NCHW) through im2col + GEMM.
