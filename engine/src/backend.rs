//! The built-in CPU compute backend: matrix products through the `gemm` crate
//! (AVX-512 kernels with feature `x86-v4`), plus the thread-count knob.

use std::sync::atomic::{AtomicUsize, Ordering};

static THREADS: AtomicUsize = AtomicUsize::new(1);

/// Sets how many threads one matrix product may use (default 1: each worker owns a core).
pub fn set_threads(threads: usize) {
    THREADS.store(threads.max(1), Ordering::Relaxed);
}

/// Threads one matrix product may use.
pub fn threads() -> usize {
    THREADS.load(Ordering::Relaxed)
}

/// `c[m×n] (+)= op(a) · op(b)` with row-major operands.
///
/// `a` is `[m×k]` (or `[k×m]` when `trans_a`), `b` is `[k×n]` (or `[n×k]` when `trans_b`).
/// With `accumulate` the product is added to `c`, otherwise `c` is overwritten.
///
/// # Panics
/// When a slice is shorter than its declared matrix (an engine bug, never input-driven).
pub fn matmul(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) {
    assert!(
        c.len() >= m * n && a.len() >= m * k && b.len() >= k * n,
        "matmul operand sizes"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    // Strides (column stride, row stride) in elements for the logical matrices.
    let (a_cs, a_rs) = if trans_a {
        (m as isize, 1)
    } else {
        (1, k as isize)
    };
    let (b_cs, b_rs) = if trans_b {
        (k as isize, 1)
    } else {
        (1, n as isize)
    };
    let parallelism = match threads() {
        1 => gemm::Parallelism::None,
        t => gemm::Parallelism::Rayon(t),
    };
    // SAFETY: the asserts above guarantee every index the strides can produce lies inside
    // the slices; `c` is uniquely borrowed and does not alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    let av = if ta { a[p * m + i] } else { a[i * k + p] };
                    let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                    s += av * bv;
                }
                c[i * n + j] = s;
            }
        }
        c
    }

    #[test]
    fn matmul_matches_naive_for_all_transposes() {
        let (m, k, n) = (7, 13, 5);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 17 % 7) as f32 - 3.0) * 0.2)
            .collect();
        for ta in [false, true] {
            for tb in [false, true] {
                let want = naive(&a, &b, m, k, n, ta, tb);
                let mut c = vec![1.0; m * n];
                matmul(&mut c, &a, &b, m, k, n, ta, tb, false);
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - y).abs() < 1e-4, "{ta} {tb}: {x} vs {y}");
                }
                let mut c2 = vec![1.0; m * n];
                matmul(&mut c2, &a, &b, m, k, n, ta, tb, true);
                for (x, y) in c2.iter().zip(&want) {
                    assert!((x - (y + 1.0)).abs() < 1e-4);
                }
            }
        }
    }
}
