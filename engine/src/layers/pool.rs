//! 2-D max pooling (NCHW).
//!
//! Owns [`MaxPool2d`]: windows of `kernel × kernel` every `stride` positions without padding
//! (PyTorch's `MaxPool2d(kernel, stride)`, floor mode). Forward remembers, per output, the
//! position of the maximum inside its input plane; backward routes each output gradient to
//! that position (adding up where overlapping windows share a maximum).

use crate::layer::Layer;
use crate::tensor::Tensor;

/// Max pooling over NCHW tensors with square windows and equal strides, no padding.
pub struct MaxPool2d {
    kernel: usize,
    stride: usize,
    /// Input shape `[n, c, h, w]` of the last training forward pass.
    cached_shape: [usize; 4],
    /// For each output element, the index of its maximum within its `h·w` input plane.
    argmax: Vec<u32>,
}

impl MaxPool2d {
    /// A max pool with the given window side and stride.
    ///
    /// # Panics
    /// When `kernel` or `stride` is zero (an engine bug: model builders pass constants).
    pub fn new(kernel: usize, stride: usize) -> Self {
        assert!(kernel > 0 && stride > 0, "maxpool2d: zero kernel or stride");
        Self {
            kernel,
            stride,
            cached_shape: [0; 4],
            argmax: Vec::new(),
        }
    }

    /// Window side length.
    pub fn kernel(&self) -> usize {
        self.kernel
    }

    /// Stride on both spatial axes.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Output spatial size `(H_out, W_out)` for an input of `height × width`.
    ///
    /// # Panics
    /// When the window is larger than the input.
    pub fn output_size(&self, height: usize, width: usize) -> (usize, usize) {
        assert!(
            height >= self.kernel && width >= self.kernel,
            "maxpool2d: window {} larger than input {height}×{width}",
            self.kernel
        );
        (
            (height - self.kernel) / self.stride + 1,
            (width - self.kernel) / self.stride + 1,
        )
    }
}

/// Window geometry over one `h × w` input plane.
#[derive(Clone, Copy)]
struct PlaneGeometry {
    width: usize,
    kernel: usize,
    stride: usize,
    out_h: usize,
    out_w: usize,
}

impl PlaneGeometry {
    /// Any window and stride. The window's first row seeds the maximum; later positions
    /// replace it only when strictly larger, so ties resolve to the first position in
    /// row-major order.
    fn pool_any(&self, plane: &[f32], out_plane: &mut [f32], arg_plane: &mut [u32]) {
        let PlaneGeometry {
            width: w,
            kernel: k,
            stride: s,
            out_h: oh,
            out_w: ow,
        } = *self;
        for oy in 0..oh {
            let out_row = &mut out_plane[oy * ow..(oy + 1) * ow];
            let arg_row = &mut arg_plane[oy * ow..(oy + 1) * ow];
            let first = oy * s * w;
            for (ox, (best, arg)) in out_row.iter_mut().zip(arg_row.iter_mut()).enumerate() {
                let start = first + ox * s;
                let mut best_at = start;
                for (j, v) in plane[start + 1..start + k].iter().enumerate() {
                    if *v > plane[best_at] {
                        best_at = start + 1 + j;
                    }
                }
                *best = plane[best_at];
                *arg = best_at as u32;
            }
            for kh in 1..k {
                let row_start = (oy * s + kh) * w;
                for (ox, (best, arg)) in out_row.iter_mut().zip(arg_row.iter_mut()).enumerate() {
                    let start = row_start + ox * s;
                    for (j, v) in plane[start..start + k].iter().enumerate() {
                        if *v > *best {
                            *best = *v;
                            *arg = (start + j) as u32;
                        }
                    }
                }
            }
        }
    }

    /// The common 2×2 window with stride 2, same tie rule as [`Self::pool_any`].
    fn pool_2x2(&self, plane: &[f32], out_plane: &mut [f32], arg_plane: &mut [u32]) {
        let PlaneGeometry {
            width: w,
            out_h: oh,
            out_w: ow,
            ..
        } = *self;
        let rows = out_plane
            .chunks_exact_mut(ow)
            .zip(arg_plane.chunks_exact_mut(ow));
        for (oy, (out_row, arg_row)) in rows.enumerate().take(oh) {
            let top_start = 2 * oy * w;
            let top = &plane[top_start..top_start + 2 * ow];
            let bottom = &plane[top_start + w..top_start + w + 2 * ow];
            let windows = top.chunks_exact(2).zip(bottom.chunks_exact(2));
            for (ox, ((best, arg), (t, b))) in out_row
                .iter_mut()
                .zip(arg_row.iter_mut())
                .zip(windows)
                .enumerate()
            {
                let at = (top_start + 2 * ox) as u32;
                let (mut m, mut m_at) = (t[0], at);
                if t[1] > m {
                    (m, m_at) = (t[1], at + 1);
                }
                if b[0] > m {
                    (m, m_at) = (b[0], at + w as u32);
                }
                if b[1] > m {
                    (m, m_at) = (b[1], at + w as u32 + 1);
                }
                *best = m;
                *arg = m_at;
            }
        }
    }
}

impl Layer for MaxPool2d {
    fn kind(&self) -> &'static str {
        "maxpool2d"
    }

    fn forward(&mut self, input: &Tensor, train: bool) -> Tensor {
        assert_eq!(
            input.shape.len(),
            4,
            "maxpool2d expects [n, c, h, w], got {:?}",
            input.shape
        );
        let [n, c, h, w] = [
            input.shape[0],
            input.shape[1],
            input.shape[2],
            input.shape[3],
        ];
        assert!(
            h * w <= u32::MAX as usize,
            "maxpool2d: plane too large for u32 indices"
        );
        let (oh, ow) = self.output_size(h, w);
        let (k, s) = (self.kernel, self.stride);
        let mut out = Tensor::zeros(&[n, c, oh, ow]);
        self.argmax.resize(n * c * oh * ow, 0);
        let planes = input
            .data
            .chunks_exact(h * w)
            .zip(out.data.chunks_exact_mut(oh * ow))
            .zip(self.argmax.chunks_exact_mut(oh * ow));
        let plane_geometry = PlaneGeometry {
            width: w,
            kernel: k,
            stride: s,
            out_h: oh,
            out_w: ow,
        };
        for ((plane, out_plane), arg_plane) in planes {
            if k == 2 && s == 2 {
                plane_geometry.pool_2x2(plane, out_plane, arg_plane);
            } else {
                plane_geometry.pool_any(plane, out_plane, arg_plane);
            }
        }
        if train {
            self.cached_shape = [n, c, h, w];
        } else {
            self.argmax.clear();
        }
        out
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        let [n, c, h, w] = self.cached_shape;
        let (oh, ow) = self.output_size(h, w);
        assert_eq!(
            grad_output.shape,
            [n, c, oh, ow],
            "maxpool2d backward: gradient shape does not match the last training forward"
        );
        assert_eq!(
            self.argmax.len(),
            grad_output.len(),
            "maxpool2d backward without forward"
        );
        let mut grad_input = Tensor::zeros(&[n, c, h, w]);
        let planes = grad_input
            .data
            .chunks_exact_mut(h * w)
            .zip(grad_output.data.chunks_exact(oh * ow))
            .zip(self.argmax.chunks_exact(oh * ow));
        for ((grad_plane, grad_out_plane), arg_plane) in planes {
            for (g, at) in grad_out_plane.iter().zip(arg_plane) {
                grad_plane[*at as usize] += *g;
            }
        }
        grad_input
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use proptest::prelude::*;

    /// Distinct values in a shuffled order, spaced 0.1 apart (no ties within ±eps).
    fn distinct_input(shape: &[usize], seed: usize) -> Tensor {
        let len: usize = shape.iter().product();
        // Multiplying by a number coprime to len permutes 0..len.
        let mut step = 7919 + seed * 2;
        while gcd(step, len) != 1 {
            step += 1;
        }
        let data = (0..len)
            .map(|i| ((i * step) % len) as f32 * 0.1 - 1.0)
            .collect();
        Tensor::from_vec(shape, data)
    }

    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }

    /// Max pooling by definition, for reference.
    fn naive_pool(input: &Tensor, k: usize, s: usize) -> Tensor {
        let [n, c, h, w] = [
            input.shape[0],
            input.shape[1],
            input.shape[2],
            input.shape[3],
        ];
        let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
        let mut out = Tensor::zeros(&[n, c, oh, ow]);
        for p in 0..n * c {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut m = f32::NEG_INFINITY;
                    for kh in 0..k {
                        for kw in 0..k {
                            m = m.max(input.data[(p * h + oy * s + kh) * w + ox * s + kw]);
                        }
                    }
                    out.data[(p * oh + oy) * ow + ox] = m;
                }
            }
        }
        out
    }

    #[test]
    fn gradcheck_non_overlapping_and_overlapping_windows() {
        for (k, s) in [(2, 2), (3, 2), (2, 1)] {
            let mut layer = MaxPool2d::new(k, s);
            let input = distinct_input(&[2, 3, 5, 6], k + s);
            check_layer(&mut layer, &input, true, 1e-2, 1e-3);
        }
    }

    #[test]
    fn routes_gradient_to_the_maximum() {
        let mut layer = MaxPool2d::new(2, 2);
        let input = Tensor::from_vec(&[1, 1, 2, 4], vec![1.0, 5.0, 2.0, 0.0, 3.0, 4.0, 9.0, 8.0]);
        let out = layer.forward(&input, true);
        assert_eq!(out.shape, [1, 1, 1, 2]);
        assert_eq!(out.data, [5.0, 9.0]);
        let grad = layer.backward(&Tensor::from_vec(&[1, 1, 1, 2], vec![0.5, -2.0]));
        assert_eq!(grad.data, [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, -2.0, 0.0]);
    }

    #[test]
    fn odd_sizes_floor_the_output() {
        let mut layer = MaxPool2d::new(2, 2);
        let out = layer.forward(&Tensor::zeros(&[3, 2, 7, 5]), false);
        assert_eq!(out.shape, [3, 2, 3, 2]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(60))]
        #[test]
        fn forward_matches_definition(
            n in 1usize..3, c in 1usize..3, k in 1usize..4, s in 1usize..4,
            extra_h in 0usize..5, extra_w in 0usize..5,
            values in proptest::collection::vec(-10.0f32..10.0, 2 * 2 * 7 * 7),
        ) {
            let (h, w) = (k + extra_h, k + extra_w);
            let len = n * c * h * w;
            let input = Tensor::from_vec(&[n, c, h, w], values[..len].to_vec());
            let got = MaxPool2d::new(k, s).forward(&input, true);
            prop_assert_eq!(got, naive_pool(&input, k, s));
        }
    }
}
