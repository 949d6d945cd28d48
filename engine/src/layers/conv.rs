//! 2-D convolution (NCHW) through im2col + GEMM.
//!
//! Owns [`Conv2d`] and its column transforms. Forward lowers one image at a time into a
//! reused column buffer `[in·k·k, H_out·W_out]` and multiplies it with the weight matrix
//! `[out, in·k·k]`; the product lands directly in the NCHW output slice of that image.
//! Backward rebuilds each image's columns from the cached input and computes
//! `dW += grad · colsᵀ`, `dcols = Wᵀ · grad`, then col2im for the input gradient.
//!
//! Measured on the `cnn` model (batch 128): per-image products beat one batch-wide product
//! (the operands stay in L2), and rebuilding the columns in backward beats caching the
//! columns of the whole batch (tens of MB that fall out of cache).

use rand::Rng;

use crate::backend::matmul;
use crate::layer::{Layer, Param};
use crate::tensor::Tensor;

/// A 2-D convolution over NCHW tensors with square kernels, equal stride and zero padding
/// on both spatial axes. Parameters: `weight` `[out_ch, in_ch, kernel, kernel]` and
/// `bias` `[out_ch]`.
pub struct Conv2d {
    in_ch: usize,
    out_ch: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    /// `[weight, bias]`.
    params: Vec<Param>,
    /// Input spatial size of the last forward pass (or the configured one), for the MAC count.
    input_hw: Option<(usize, usize)>,
    /// Whether backward computes the input gradient (false for a first layer fed with data).
    input_grad: bool,
    /// Input shape `[n, c, h, w]` of the last training forward pass.
    cached_shape: [usize; 4],
    /// The input of the last training forward pass (reused buffer).
    cached_input: Vec<f32>,
    /// Column buffer of one image, `[in·k·k, H_out·W_out]` (reused).
    cols: Vec<f32>,
    /// Gradient w.r.t. the columns of one image (reused).
    grad_cols: Vec<f32>,
}

/// Sum of `values` in eight independent lanes (vectorizes; a sequential sum does not).
fn sum(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = values.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane += *v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Output extent of one spatial axis.
fn out_extent(input: usize, kernel: usize, stride: usize, padding: usize) -> usize {
    assert!(
        input + 2 * padding >= kernel,
        "conv2d: kernel {kernel} larger than padded input {input}+2·{padding}"
    );
    (input + 2 * padding - kernel) / stride + 1
}

/// The range `[lo, hi)` of output positions whose input position `o·stride + offset − padding`
/// lies inside `[0, input)`, for kernel offset `offset`.
#[inline]
fn valid_range(
    input: usize,
    out: usize,
    offset: usize,
    stride: usize,
    padding: usize,
) -> (usize, usize) {
    let lo = if padding > offset {
        (padding - offset).div_ceil(stride)
    } else {
        0
    };
    let hi = if input + padding > offset {
        (input + padding - offset).div_ceil(stride)
    } else {
        0
    };
    let lo = lo.min(out);
    (lo, hi.min(out).max(lo))
}

/// Geometry of one image's column transform.
#[derive(Clone, Copy)]
struct Geometry {
    channels: usize,
    height: usize,
    width: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    out_h: usize,
    out_w: usize,
}

impl Geometry {
    /// Writes the columns of `image` (`[channels, height, width]`) into
    /// `cols` (`[channels·k·k, out_h·out_w]`), zeros where the window reads padding.
    fn im2col(&self, image: &[f32], cols: &mut [f32]) {
        let Geometry {
            channels,
            height,
            width,
            kernel,
            stride,
            padding,
            out_h,
            out_w,
        } = *self;
        let plane = height * width;
        let out_plane = out_h * out_w;
        let image = &image[..channels * plane];
        let mut rows = cols[..channels * kernel * kernel * out_plane].chunks_exact_mut(out_plane);
        for ci in 0..channels {
            let channel = &image[ci * plane..(ci + 1) * plane];
            for kh in 0..kernel {
                let (y_lo, y_hi) = valid_range(height, out_h, kh, stride, padding);
                for kw in 0..kernel {
                    let (x_lo, x_hi) = valid_range(width, out_w, kw, stride, padding);
                    let row = rows.next().expect("column rows match the geometry");
                    row[..y_lo * out_w].fill(0.0);
                    row[y_hi * out_w..].fill(0.0);
                    for oy in y_lo..y_hi {
                        let iy = oy * stride + kh - padding;
                        let src_row = &channel[iy * width..(iy + 1) * width];
                        let dst = &mut row[oy * out_w..(oy + 1) * out_w];
                        dst[..x_lo].fill(0.0);
                        dst[x_hi..].fill(0.0);
                        let dst = &mut dst[x_lo..x_hi];
                        let start = x_lo * stride + kw - padding;
                        if stride == 1 {
                            dst.copy_from_slice(&src_row[start..start + dst.len()]);
                        } else {
                            for (d, s) in
                                dst.iter_mut().zip(src_row[start..].iter().step_by(stride))
                            {
                                *d = *s;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Adds the columns `cols` back into `image` (the adjoint of [`Self::im2col`]);
    /// `image` must be zeroed by the caller.
    fn col2im(&self, cols: &[f32], image: &mut [f32]) {
        let Geometry {
            channels,
            height,
            width,
            kernel,
            stride,
            padding,
            out_h,
            out_w,
        } = *self;
        let plane = height * width;
        let out_plane = out_h * out_w;
        let image = &mut image[..channels * plane];
        let mut rows = cols[..channels * kernel * kernel * out_plane].chunks_exact(out_plane);
        for ci in 0..channels {
            let channel = &mut image[ci * plane..(ci + 1) * plane];
            for kh in 0..kernel {
                let (y_lo, y_hi) = valid_range(height, out_h, kh, stride, padding);
                for kw in 0..kernel {
                    let (x_lo, x_hi) = valid_range(width, out_w, kw, stride, padding);
                    let row = rows.next().expect("column rows match the geometry");
                    for oy in y_lo..y_hi {
                        let iy = oy * stride + kh - padding;
                        let dst_row = &mut channel[iy * width..(iy + 1) * width];
                        let src = &row[oy * out_w + x_lo..oy * out_w + x_hi];
                        let start = x_lo * stride + kw - padding;
                        if stride == 1 {
                            for (d, s) in dst_row[start..start + src.len()].iter_mut().zip(src) {
                                *d += *s;
                            }
                        } else {
                            for (d, s) in dst_row[start..].iter_mut().step_by(stride).zip(src) {
                                *d += *s;
                            }
                        }
                    }
                }
            }
        }
    }
}

impl Conv2d {
    /// A convolution with PyTorch's default initialization: weight and bias uniform in
    /// `±1/sqrt(in_ch·kernel·kernel)` (Kaiming-uniform with `a = √5`).
    ///
    /// # Panics
    /// When a size is zero (an engine bug: model builders pass constants).
    pub fn new(
        in_ch: usize,
        out_ch: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        rng: &mut impl Rng,
    ) -> Self {
        assert!(
            in_ch > 0 && out_ch > 0 && kernel > 0 && stride > 0,
            "conv2d: zero-sized configuration"
        );
        let fan_in = in_ch * kernel * kernel;
        let bound = 1.0 / (fan_in as f32).sqrt();
        let weight: Vec<f32> = (0..out_ch * fan_in)
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        let bias: Vec<f32> = (0..out_ch)
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        Self {
            in_ch,
            out_ch,
            kernel,
            stride,
            padding,
            params: vec![
                Param::new("weight", &[out_ch, in_ch, kernel, kernel], weight),
                Param::new("bias", &[out_ch], bias),
            ],
            input_hw: None,
            input_grad: true,
            cached_shape: [0; 4],
            cached_input: Vec::new(),
            cols: Vec::new(),
            grad_cols: Vec::new(),
        }
    }

    /// Declares the input spatial size so [`Layer::forward_macs_per_sample`] is exact before the
    /// first forward pass (each forward pass updates it from the actual input).
    pub fn with_input_size(mut self, height: usize, width: usize) -> Self {
        self.input_hw = Some((height, width));
        self
    }

    /// Makes backward skip the input gradient and return zeros instead: for a first layer
    /// whose input is data, where nobody reads that gradient (PyTorch skips it the same way
    /// for inputs that do not require grad). Saves one GEMM and the col2im per image.
    pub fn without_input_grad(mut self) -> Self {
        self.input_grad = false;
        self
    }

    /// Input channels.
    pub fn in_ch(&self) -> usize {
        self.in_ch
    }

    /// Output channels.
    pub fn out_ch(&self) -> usize {
        self.out_ch
    }

    /// Kernel side length.
    pub fn kernel(&self) -> usize {
        self.kernel
    }

    /// Stride on both spatial axes.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Zero padding on each side of both spatial axes.
    pub fn padding(&self) -> usize {
        self.padding
    }

    /// Output spatial size `(H_out, W_out)` for an input of `height × width`.
    ///
    /// # Panics
    /// When the kernel does not fit in the padded input.
    pub fn output_size(&self, height: usize, width: usize) -> (usize, usize) {
        (
            out_extent(height, self.kernel, self.stride, self.padding),
            out_extent(width, self.kernel, self.stride, self.padding),
        )
    }

    fn geometry(&self, height: usize, width: usize) -> Geometry {
        let (out_h, out_w) = self.output_size(height, width);
        Geometry {
            channels: self.in_ch,
            height,
            width,
            kernel: self.kernel,
            stride: self.stride,
            padding: self.padding,
            out_h,
            out_w,
        }
    }

    /// Splits a 4-D NCHW shape, checking the channel count.
    fn nchw(&self, shape: &[usize]) -> [usize; 4] {
        assert!(
            shape.len() == 4 && shape[1] == self.in_ch,
            "conv2d expects [n, {}, h, w], got {shape:?}",
            self.in_ch
        );
        [shape[0], shape[1], shape[2], shape[3]]
    }
}

impl Layer for Conv2d {
    fn kind(&self) -> &'static str {
        "conv2d"
    }

    fn forward(&mut self, input: &Tensor, train: bool) -> Tensor {
        let [n, c, h, w] = self.nchw(&input.shape);
        let geo = self.geometry(h, w);
        self.input_hw = Some((h, w));
        let out_plane = geo.out_h * geo.out_w;
        let col_rows = c * self.kernel * self.kernel;
        let cols_len = col_rows * out_plane;
        self.cols.resize(cols_len, 0.0);

        let mut out = Tensor::zeros(&[n, self.out_ch, geo.out_h, geo.out_w]);
        let image_len = c * h * w;
        let (weight, bias) = (&self.params[0].value, &self.params[1].value);
        let images = input
            .data
            .chunks_exact(image_len)
            .zip(out.data.chunks_exact_mut(self.out_ch * out_plane));
        for (image, out_image) in images {
            for (channel, b) in out_image.chunks_exact_mut(out_plane).zip(bias) {
                channel.fill(*b);
            }
            geo.im2col(image, &mut self.cols);
            matmul(
                out_image,
                weight,
                &self.cols,
                self.out_ch,
                col_rows,
                out_plane,
                false,
                false,
                true,
            );
        }
        if train {
            self.cached_shape = [n, c, h, w];
            self.cached_input.clear();
            self.cached_input.extend_from_slice(&input.data);
        } else {
            self.cached_shape = [0; 4];
        }
        out
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        let [n, c, h, w] = self.cached_shape;
        assert_eq!(c, self.in_ch, "conv2d backward without a training forward");
        let geo = self.geometry(h, w);
        let out_plane = geo.out_h * geo.out_w;
        assert_eq!(
            grad_output.shape,
            [n, self.out_ch, geo.out_h, geo.out_w],
            "conv2d backward: gradient shape does not match the last training forward"
        );
        let col_rows = c * self.kernel * self.kernel;
        let cols_len = col_rows * out_plane;
        self.cols.resize(cols_len, 0.0);
        if self.input_grad {
            self.grad_cols.resize(cols_len, 0.0);
        }

        let mut grad_input = Tensor::zeros(&[n, c, h, w]);
        let image_len = c * h * w;
        let [weight, bias] = &mut self.params[..] else {
            unreachable!("conv2d has exactly weight and bias")
        };
        weight.grad.fill(0.0);
        bias.grad.fill(0.0);
        let images = self
            .cached_input
            .chunks_exact(image_len)
            .zip(grad_output.data.chunks_exact(self.out_ch * out_plane))
            .zip(grad_input.data.chunks_exact_mut(image_len));
        for ((image, grad_image), grad_in_image) in images {
            for (db, g) in bias.grad.iter_mut().zip(grad_image.chunks_exact(out_plane)) {
                *db += sum(g);
            }
            geo.im2col(image, &mut self.cols);
            let (m, k, n) = (self.out_ch, out_plane, col_rows);
            // dW[out, c·k·k] += grad[out, hw] · cols[c·k·k, hw]ᵀ
            matmul(
                &mut weight.grad,
                grad_image,
                &self.cols,
                m,
                k,
                n,
                false,
                true,
                true,
            );
            if self.input_grad {
                // dcols[c·k·k, hw] = Wᵀ · grad
                let (m, k, n) = (col_rows, self.out_ch, out_plane);
                matmul(
                    &mut self.grad_cols,
                    &weight.value,
                    grad_image,
                    m,
                    k,
                    n,
                    true,
                    false,
                    false,
                );
                geo.col2im(&self.grad_cols, grad_in_image);
            }
        }
        grad_input
    }

    fn params(&self) -> &[Param] {
        &self.params
    }

    fn params_mut(&mut self) -> &mut [Param] {
        &mut self.params
    }

    /// `out·in·k·k·H_out·W_out` for the last (or configured) input size; the parameter
    /// count when no input size is known yet.
    fn forward_macs_per_sample(&self) -> u64 {
        match self.input_hw {
            Some((h, w)) => {
                let (oh, ow) = self.output_size(h, w);
                (self.out_ch * self.in_ch * self.kernel * self.kernel * oh * ow) as u64
            }
            None => self.params.iter().map(|p| p.len() as u64).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, pseudo_random};
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// Direct convolution by definition, for reference.
    fn naive_conv(conv: &Conv2d, input: &Tensor) -> Tensor {
        let [n, c, h, w] = [
            input.shape[0],
            input.shape[1],
            input.shape[2],
            input.shape[3],
        ];
        let (oh, ow) = conv.output_size(h, w);
        let (k, s, p) = (conv.kernel, conv.stride, conv.padding as isize);
        let (wt, b) = (&conv.params[0].value, &conv.params[1].value);
        let mut out = Tensor::zeros(&[n, conv.out_ch, oh, ow]);
        for ni in 0..n {
            for o in 0..conv.out_ch {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = b[o];
                        for ci in 0..c {
                            for kh in 0..k {
                                for kw in 0..k {
                                    let iy = (oy * s + kh) as isize - p;
                                    let ix = (ox * s + kw) as isize - p;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                        continue;
                                    }
                                    let x = input.data
                                        [((ni * c + ci) * h + iy as usize) * w + ix as usize];
                                    acc += wt[((o * c + ci) * k + kh) * k + kw] * x;
                                }
                            }
                        }
                        out.data[((ni * conv.out_ch + o) * oh + oy) * ow + ox] = acc;
                    }
                }
            }
        }
        out
    }

    fn conv(in_ch: usize, out_ch: usize, k: usize, s: usize, p: usize, seed: u64) -> Conv2d {
        Conv2d::new(in_ch, out_ch, k, s, p, &mut ChaCha8Rng::seed_from_u64(seed))
    }

    #[test]
    fn gradcheck_over_strides_and_paddings() {
        for (stride, padding) in [(1, 0), (1, 1), (2, 0), (2, 1)] {
            let mut layer = conv(2, 3, 3, stride, padding, 7);
            let input = Tensor::from_vec(&[2, 2, 5, 6], pseudo_random(2 * 2 * 5 * 6, 3));
            check_layer(&mut layer, &input, true, 1e-2, 1e-2);
        }
    }

    #[test]
    fn gradcheck_padding_wider_than_kernel_reach() {
        // padding 2 with a 2×2 kernel: whole output rows/columns read only padding.
        let mut layer = conv(1, 2, 2, 1, 2, 11);
        let input = Tensor::from_vec(&[2, 1, 3, 3], pseudo_random(18, 5));
        check_layer(&mut layer, &input, true, 1e-2, 1e-2);
    }

    #[test]
    fn without_input_grad_keeps_param_grads_and_zeroes_input_grad() {
        let input = Tensor::from_vec(&[2, 2, 6, 5], pseudo_random(120, 8));
        let mut full = conv(2, 3, 3, 1, 1, 4);
        let mut skipping = conv(2, 3, 3, 1, 1, 4).without_input_grad();
        let out = full.forward(&input, true);
        assert_eq!(skipping.forward(&input, true), out);
        let grad = Tensor::from_vec(&out.shape, pseudo_random(out.len(), 9));
        let full_in = full.backward(&grad);
        let skipped_in = skipping.backward(&grad);
        assert_eq!(full.params, skipping.params);
        assert!(full_in.data.iter().any(|g| *g != 0.0));
        assert_eq!(skipped_in, Tensor::zeros(&input.shape));
    }

    #[test]
    fn output_shape_and_macs() {
        let mut layer = conv(1, 16, 5, 1, 2, 1).with_input_size(28, 28);
        assert_eq!(layer.forward_macs_per_sample(), 16 * 25 * 28 * 28);
        let out = layer.forward(&Tensor::zeros(&[3, 1, 10, 12]), false);
        assert_eq!(out.shape, [3, 16, 10, 12]);
        assert_eq!(layer.forward_macs_per_sample(), 16 * 25 * 10 * 12);
        let strided = conv(3, 4, 3, 2, 0, 1);
        assert_eq!(strided.output_size(9, 8), (4, 3));
    }

    #[test]
    fn init_is_seeded_and_bounded() {
        let a = conv(4, 8, 3, 1, 1, 42);
        let b = conv(4, 8, 3, 1, 1, 42);
        let other = conv(4, 8, 3, 1, 1, 43);
        assert_eq!(a.params, b.params);
        assert_ne!(a.params[0].value, other.params[0].value);
        let bound = 1.0 / 36f32.sqrt();
        for p in &a.params {
            assert!(p.value.iter().all(|v| v.abs() <= bound));
            // Uniform over ±bound: some values must come close to the bound.
            assert!(p.value.iter().any(|v| v.abs() > 0.5 * bound));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]
        #[test]
        fn forward_matches_direct_convolution(
            n in 1usize..3, c in 1usize..4, o in 1usize..4, k in 1usize..4,
            stride in 1usize..3, padding in 0usize..3, extra_h in 0usize..5, extra_w in 0usize..5,
            seed in 0u64..1000,
        ) {
            let (h, w) = (k + extra_h, k + extra_w);
            let mut layer = conv(c, o, k, stride, padding, seed);
            let input = Tensor::from_vec(&[n, c, h, w], pseudo_random(n * c * h * w, seed));
            let got = layer.forward(&input, false);
            let want = naive_conv(&layer, &input);
            prop_assert_eq!(&got.shape, &want.shape);
            for (g, e) in got.data.iter().zip(&want.data) {
                prop_assert!((g - e).abs() < 1e-4, "{} vs {}", g, e);
            }
        }
    }
}
