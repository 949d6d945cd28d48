//! 2-D convolution (NCHW) through im2col + GEMM.
//!
//! Owns [`Conv2d`] and its column transforms. Forward first copies the batch once into a
//! zero-padded buffer (whose borders stay zero between calls), so the column transform is
//! a branch-free gather of short rows. It lowers a group of images at a time into a reused
//! column buffer `[in·k·k, G·H_out·W_out]` and multiplies it with the weight matrix
//! `[out, in·k·k]` in one GEMM, then adds the bias while scattering the product into NCHW.
//! The padded buffer doubles as the cache for backward, which rebuilds the columns of each
//! group and computes `dW (+)= grad · colsᵀ` (one GEMM over the group, the first group
//! overwriting), `dcols = Wᵀ · grad`, then col2im into a padded gradient image.
//!
//! Measured on the `cnn` model (batch 128): groups whose columns stay in L2 beat both
//! per-image products and one batch-wide product (tens of MB that fall out of cache), and
//! rebuilding the columns in backward beats caching the columns of the whole batch.

use rand::Rng;

use crate::backend::matmul;
use crate::layer::{Layer, Param};
use crate::tensor::Tensor;

/// The GEMM (the `gemm` crate, AVX-512) reads a column matrix in place, without packing it,
/// when its number of output positions is a multiple of 16 f32 lanes; measured on the `cnn`
/// model, packing costs more than a larger group.
const GEMM_ROW_MULTIPLE: usize = 16;

/// Most images lowered into one column buffer (larger groups fall out of L2).
const MAX_GROUP_IMAGES: usize = 4;

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
    /// Input shape `[n, c, h, w]` of the last training forward pass (zeros when none).
    cached_shape: [usize; 4],
    /// Input shape `[n, c, h, w]` whose zero-padded copy [`Self::padded`] holds.
    padded_shape: [usize; 4],
    /// The last forward input, zero-padded: `[n, c, h + 2p, w + 2p]` (reused buffer; the
    /// borders are written once per shape and stay zero).
    padded: Vec<f32>,
    /// Column buffer of one group of images, `[in·k·k, G·H_out·W_out]` (reused).
    cols: Vec<f32>,
    /// Output or output gradient of one group, `[out, G·H_out·W_out]` (reused).
    group_out: Vec<f32>,
    /// Gradient w.r.t. the columns of one group (reused).
    grad_cols: Vec<f32>,
    /// Input gradient of one image, zero-padded `[c, h + 2p, w + 2p]` (reused).
    grad_padded: Vec<f32>,
    /// Output-gradient shape whose padded copy [`Self::padded_grad`] holds.
    padded_grad_shape: [usize; 4],
    /// The output gradient padded by `kernel − 1 − padding` (full-convolution backward).
    padded_grad: Vec<f32>,
    /// The weights flipped in space and transposed in channels, `[in, out·k·k]`.
    flipped_weight: Vec<f32>,
    /// Input gradient of one group, `[in, G·H·W]` (reused).
    group_in: Vec<f32>,
    /// The weight gradient transposed, `[in·k·k, out]` (reused).
    weight_grad_t: Vec<f32>,
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

/// Copies `src` into `dst` (equal lengths) in blocks of eight values, the last block
/// overlapping its predecessor: a few vector moves for the short rows of a column
/// transform, where `copy_from_slice` would call `memcpy` once per row.
#[inline(always)]
fn copy_short(dst: &mut [f32], src: &[f32]) {
    const BLOCK: usize = 8;
    let len = dst.len();
    let src = &src[..len];
    if len < BLOCK {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = *s;
        }
        return;
    }
    let mut start = 0;
    while start + BLOCK <= len {
        let block: [f32; BLOCK] = src[start..start + BLOCK].try_into().expect("8 values");
        dst[start..start + BLOCK].copy_from_slice(&block);
        start += BLOCK;
    }
    if start < len {
        let block: [f32; BLOCK] = src[len - BLOCK..].try_into().expect("8 values");
        dst[len - BLOCK..].copy_from_slice(&block);
    }
}

/// Output extent of one spatial axis.
fn out_extent(input: usize, kernel: usize, stride: usize, padding: usize) -> usize {
    assert!(
        input + 2 * padding >= kernel,
        "conv2d: kernel {kernel} larger than padded input {input}+2·{padding}"
    );
    (input + 2 * padding - kernel) / stride + 1
}

/// Geometry of one image's column transform over its zero-padded copy.
#[derive(Clone, Copy)]
struct Geometry {
    channels: usize,
    /// Padded height `h + 2p`.
    padded_h: usize,
    /// Padded width `w + 2p`.
    padded_w: usize,
    kernel: usize,
    stride: usize,
    out_h: usize,
    out_w: usize,
}

impl Geometry {
    /// Values in one padded image.
    fn padded_len(&self) -> usize {
        self.channels * self.padded_h * self.padded_w
    }

    /// Values in one output plane.
    fn out_plane(&self) -> usize {
        self.out_h * self.out_w
    }

    /// Start of the padded-image values read by output row `oy` at kernel offset `(kh, kw)`
    /// in channel `ci`.
    #[inline(always)]
    fn source_start(&self, ci: usize, kh: usize, kw: usize, oy: usize) -> usize {
        (ci * self.padded_h + oy * self.stride + kh) * self.padded_w + kw
    }

    /// Writes the columns of `padded_image` (`[channels, padded_h, padded_w]`) into the
    /// column block starting at `col_offset` of each row of `cols`, whose rows
    /// (`channels·k·k` of them) are `row_len` values long.
    fn im2col(&self, padded_image: &[f32], cols: &mut [f32], row_len: usize, col_offset: usize) {
        let (kernel, stride, out_w) = (self.kernel, self.stride, self.out_w);
        let out_plane = self.out_plane();
        let plane_len = self.padded_h * self.padded_w;
        let image = &padded_image[..self.padded_len()];
        let mut rows = cols[..self.channels * kernel * kernel * row_len].chunks_exact_mut(row_len);
        for plane in image.chunks_exact(plane_len) {
            for kh in 0..kernel {
                for kw in 0..kernel {
                    let row = rows.next().expect("column rows match the geometry");
                    let block = &mut row[col_offset..col_offset + out_plane];
                    let first = kh * self.padded_w + kw;
                    if stride == 1 {
                        let sources = plane[first..].chunks(self.padded_w);
                        for (dst, src) in block.chunks_exact_mut(out_w).zip(sources) {
                            copy_short(dst, &src[..out_w]);
                        }
                    } else {
                        let sources = plane[first..].chunks(stride * self.padded_w);
                        for (dst, src) in block.chunks_exact_mut(out_w).zip(sources) {
                            for (d, s) in dst.iter_mut().zip(src.iter().step_by(stride)) {
                                *d = *s;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Adds the column block at `col_offset` of `cols` (rows `row_len` long) back into
    /// `padded_image`: the adjoint of [`Self::im2col`].
    fn col2im(&self, cols: &[f32], row_len: usize, col_offset: usize, padded_image: &mut [f32]) {
        let (kernel, stride, out_w) = (self.kernel, self.stride, self.out_w);
        let out_plane = self.out_plane();
        let padded_len = self.padded_len();
        let image = &mut padded_image[..padded_len];
        let rows = cols[..self.channels * kernel * kernel * row_len].chunks_exact(row_len);
        for (r, row) in rows.enumerate() {
            let (ci, kh, kw) = (r / (kernel * kernel), r / kernel % kernel, r % kernel);
            let block = &row[col_offset..col_offset + out_plane];
            for (oy, src) in block.chunks_exact(out_w).enumerate() {
                let start = self.source_start(ci, kh, kw, oy);
                if stride == 1 {
                    for (d, s) in image[start..start + out_w].iter_mut().zip(src) {
                        *d += *s;
                    }
                } else {
                    let dst = image[start..].iter_mut().step_by(stride);
                    for (d, s) in dst.zip(src) {
                        *d += *s;
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
            padded_shape: [0; 4],
            padded: Vec::new(),
            cols: Vec::new(),
            group_out: Vec::new(),
            grad_cols: Vec::new(),
            grad_padded: Vec::new(),
            padded_grad_shape: [0; 4],
            padded_grad: Vec::new(),
            flipped_weight: Vec::new(),
            group_in: Vec::new(),
            weight_grad_t: Vec::new(),
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
            padded_h: height + 2 * self.padding,
            padded_w: width + 2 * self.padding,
            kernel: self.kernel,
            stride: self.stride,
            out_h,
            out_w,
        }
    }

    /// Images per GEMM: the fewest (up to [`MAX_GROUP_IMAGES`]) whose output positions are
    /// a multiple of [`GEMM_ROW_MULTIPLE`], else one.
    fn group_images(&self, geo: &Geometry, n: usize) -> usize {
        let out_plane = geo.out_plane().max(1);
        let aligned = (1..=MAX_GROUP_IMAGES)
            .find(|g| (g * out_plane).is_multiple_of(GEMM_ROW_MULTIPLE))
            .unwrap_or(1);
        aligned.clamp(1, n.max(1))
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
    /// Overwrites the weight and bias gradients from `grad_output` (`[n, out, H_out, W_out]`)
    /// and the cached padded input: per group, `dW (+)= grad · colsᵀ`, the first group
    /// overwriting (zero images leave zero gradients).
    fn weight_gradient(&mut self, geo: &Geometry, n: usize, group: usize, grad_output: &[f32]) {
        let out_plane = geo.out_plane();
        let col_rows = geo.channels * geo.kernel * geo.kernel;
        let grad_image_len = self.out_ch * out_plane;
        let [weight, bias] = &mut self.params[..] else {
            unreachable!("conv2d has exactly weight and bias")
        };
        self.weight_grad_t.resize(col_rows * self.out_ch, 0.0);
        if n == 0 {
            weight.grad.fill(0.0);
            bias.grad.fill(0.0);
            return;
        }
        let groups = self
            .padded
            .chunks(group * geo.padded_len())
            .zip(grad_output.chunks(group * grad_image_len));
        for (g, (padded_group, grad_group)) in groups.enumerate() {
            let images = padded_group.len() / geo.padded_len();
            let row_len = images * out_plane;
            let first = g == 0;
            // Gather the group's output gradient as [out, G·hw].
            let group_out = &mut self.group_out[..self.out_ch * row_len];
            for (i, grad_image) in grad_group.chunks_exact(grad_image_len).enumerate() {
                let rows = group_out.chunks_exact_mut(row_len);
                for (row, plane) in rows.zip(grad_image.chunks_exact(out_plane)) {
                    row[i * out_plane..(i + 1) * out_plane].copy_from_slice(plane);
                }
            }
            for (db, row) in bias.grad.iter_mut().zip(group_out.chunks_exact(row_len)) {
                *db = if first { sum(row) } else { *db + sum(row) };
            }
            for (i, padded_image) in padded_group.chunks_exact(geo.padded_len()).enumerate() {
                geo.im2col(padded_image, &mut self.cols, row_len, i * out_plane);
            }
            // dWᵀ[c·k·k, out] (+)= cols[c·k·k, G·hw] · grad[out, G·hw]ᵀ: in this orientation
            // the GEMM reads the columns in place instead of packing them.
            matmul(
                &mut self.weight_grad_t,
                &self.cols,
                group_out,
                col_rows,
                row_len,
                self.out_ch,
                false,
                true,
                !first,
            );
        }
        for (o, grad_row) in weight.grad.chunks_exact_mut(col_rows).enumerate() {
            let column = self.weight_grad_t[o..].iter().step_by(self.out_ch);
            for (g, v) in grad_row.iter_mut().zip(column) {
                *g = *v;
            }
        }
    }

    /// Input gradient as a full convolution (stride 1, `padding < kernel`): the output
    /// gradient padded by `kernel − 1 − padding`, convolved with the weights flipped in
    /// space and transposed in channels, `[in, out·k·k]`. One well-shaped GEMM per group
    /// (inner dimension `out·k·k`) instead of a thin one followed by a scatter-add.
    fn input_gradient_full_conv(
        &mut self,
        geo: &Geometry,
        shape: [usize; 4],
        group: usize,
        grad_output: &[f32],
    ) -> Vec<f32> {
        let [n, c, h, w] = shape;
        let k = self.kernel;
        let pad = k - 1 - self.padding;
        let grad_shape = [n, self.out_ch, geo.out_h, geo.out_w];
        pad_planes(
            &mut self.padded_grad,
            &mut self.padded_grad_shape,
            grad_output,
            grad_shape,
            pad,
        );
        // flipped[ci][o][kh][kw] = W[o][ci][k-1-kh][k-1-kw]
        let taps = k * k;
        self.flipped_weight.resize(c * self.out_ch * taps, 0.0);
        let weight = &self.params[0].value;
        for (ci, flipped_rows) in self
            .flipped_weight
            .chunks_exact_mut(self.out_ch * taps)
            .enumerate()
        {
            for (o, flipped) in flipped_rows.chunks_exact_mut(taps).enumerate() {
                let kernel = &weight[(o * c + ci) * taps..(o * c + ci + 1) * taps];
                for (f, v) in flipped.iter_mut().zip(kernel.iter().rev()) {
                    *f = *v;
                }
            }
        }
        let data_geo = Geometry {
            channels: self.out_ch,
            padded_h: geo.out_h + 2 * pad,
            padded_w: geo.out_w + 2 * pad,
            kernel: k,
            stride: 1,
            out_h: h,
            out_w: w,
        };
        let plane = h * w;
        let data_rows = self.out_ch * taps;
        self.grad_cols.resize(data_rows * group * plane, 0.0);
        self.group_in.resize(c * group * plane, 0.0);
        let mut grad_input = Vec::with_capacity(n * c * plane);
        for padded_group in self.padded_grad.chunks(group * data_geo.padded_len()) {
            let images = padded_group.len() / data_geo.padded_len();
            let row_len = images * plane;
            for (i, padded_image) in padded_group.chunks_exact(data_geo.padded_len()).enumerate() {
                data_geo.im2col(padded_image, &mut self.grad_cols, row_len, i * plane);
            }
            // dX[in, G·hw] = flipped[in, out·k·k] · cols[out·k·k, G·hw]
            let group_in = &mut self.group_in[..c * row_len];
            matmul(
                group_in,
                &self.flipped_weight,
                &self.grad_cols,
                c,
                data_rows,
                row_len,
                false,
                false,
                false,
            );
            for i in 0..images {
                for row in group_in.chunks_exact(row_len) {
                    grad_input.extend_from_slice(&row[i * plane..(i + 1) * plane]);
                }
            }
        }
        grad_input
    }

    /// Input gradient for any stride and padding: `dcols = Wᵀ · grad` per group, then
    /// col2im into a padded gradient image whose interior is the input gradient.
    fn input_gradient_col2im(
        &mut self,
        geo: &Geometry,
        shape: [usize; 4],
        group: usize,
        grad_output: &[f32],
    ) -> Vec<f32> {
        let [n, c, h, w] = shape;
        let out_plane = geo.out_plane();
        let col_rows = c * self.kernel * self.kernel;
        let grad_image_len = self.out_ch * out_plane;
        self.grad_cols.resize(col_rows * group * out_plane, 0.0);
        self.group_out.resize(self.out_ch * group * out_plane, 0.0);
        self.grad_padded.resize(geo.padded_len(), 0.0);
        let p = self.padding;
        let mut grad_input = Vec::with_capacity(n * c * h * w);
        for grad_group in grad_output.chunks(group * grad_image_len) {
            let images = grad_group.len() / grad_image_len;
            let row_len = images * out_plane;
            let group_out = &mut self.group_out[..self.out_ch * row_len];
            for (i, grad_image) in grad_group.chunks_exact(grad_image_len).enumerate() {
                let rows = group_out.chunks_exact_mut(row_len);
                for (row, plane) in rows.zip(grad_image.chunks_exact(out_plane)) {
                    row[i * out_plane..(i + 1) * out_plane].copy_from_slice(plane);
                }
            }
            // dcols[c·k·k, G·hw] = Wᵀ · grad
            matmul(
                &mut self.grad_cols,
                &self.params[0].value,
                group_out,
                col_rows,
                self.out_ch,
                row_len,
                true,
                false,
                false,
            );
            for i in 0..images {
                self.grad_padded.fill(0.0);
                geo.col2im(
                    &self.grad_cols,
                    row_len,
                    i * out_plane,
                    &mut self.grad_padded,
                );
                let planes = self.grad_padded.chunks_exact(geo.padded_h * geo.padded_w);
                for padded_plane in planes {
                    let rows = padded_plane[p * geo.padded_w..].chunks_exact(geo.padded_w);
                    for padded_row in rows.take(h) {
                        grad_input.extend_from_slice(&padded_row[p..p + w]);
                    }
                }
            }
        }
        grad_input
    }
}

/// Copies the planes of `source` (`[n, c, h, w]`) into the interior of `padded`
/// (`[n, c, h + 2·pad, w + 2·pad]`). `padded_shape` records the shape `padded` holds: the
/// borders are zeroed only when it changes, and stay zero because only interiors are written.
fn pad_planes(
    padded: &mut Vec<f32>,
    padded_shape: &mut [usize; 4],
    source: &[f32],
    shape: [usize; 4],
    pad: usize,
) {
    let [n, c, h, w] = shape;
    let (padded_h, padded_w) = (h + 2 * pad, w + 2 * pad);
    if *padded_shape != shape {
        padded.clear();
        padded.resize(n * c * padded_h * padded_w, 0.0);
        *padded_shape = shape;
    }
    if h * w == 0 {
        return;
    }
    let planes = padded
        .chunks_exact_mut(padded_h * padded_w)
        .zip(source.chunks_exact(h * w));
    for (padded_plane, plane) in planes {
        let padded_rows = padded_plane[pad * padded_w..].chunks_exact_mut(padded_w);
        for (padded_row, row) in padded_rows.zip(plane.chunks_exact(w)) {
            copy_short(&mut padded_row[pad..pad + w], row);
        }
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
        pad_planes(
            &mut self.padded,
            &mut self.padded_shape,
            &input.data,
            [n, c, h, w],
            self.padding,
        );
        let out_plane = geo.out_plane();
        let col_rows = c * self.kernel * self.kernel;
        let group = self.group_images(&geo, n);
        self.cols.resize(col_rows * group * out_plane, 0.0);
        self.group_out.resize(self.out_ch * group * out_plane, 0.0);

        let mut out = Vec::with_capacity(n * self.out_ch * out_plane);
        let (weight, bias) = (&self.params[0].value, &self.params[1].value);
        for padded_group in self.padded.chunks(group * geo.padded_len()) {
            let images = padded_group.len() / geo.padded_len();
            let row_len = images * out_plane;
            for (i, padded_image) in padded_group.chunks_exact(geo.padded_len()).enumerate() {
                geo.im2col(padded_image, &mut self.cols, row_len, i * out_plane);
            }
            // out[out, G·hw] = W[out, c·k·k] · cols[c·k·k, G·hw]
            let group_out = &mut self.group_out[..self.out_ch * row_len];
            matmul(
                group_out,
                weight,
                &self.cols,
                self.out_ch,
                col_rows,
                row_len,
                false,
                false,
                false,
            );
            for i in 0..images {
                let rows = group_out.chunks_exact(row_len).zip(bias);
                for (row, b) in rows {
                    let plane = &row[i * out_plane..(i + 1) * out_plane];
                    out.extend(plane.iter().map(|v| v + b));
                }
            }
        }
        self.cached_shape = if train { [n, c, h, w] } else { [0; 4] };
        Tensor::from_vec(&[n, self.out_ch, geo.out_h, geo.out_w], out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        let [n, c, h, w] = self.cached_shape;
        assert_eq!(c, self.in_ch, "conv2d backward without a training forward");
        assert_eq!(self.padded_shape, self.cached_shape, "conv2d padded cache");
        let geo = self.geometry(h, w);
        let out_plane = geo.out_plane();
        assert_eq!(
            grad_output.shape,
            [n, self.out_ch, geo.out_h, geo.out_w],
            "conv2d backward: gradient shape does not match the last training forward"
        );
        let col_rows = c * self.kernel * self.kernel;
        let group = self.group_images(&geo, n);
        self.cols.resize(col_rows * group * out_plane, 0.0);
        self.group_out.resize(self.out_ch * group * out_plane, 0.0);
        self.weight_gradient(&geo, n, group, &grad_output.data);
        let grad_input = if !self.input_grad {
            vec![0.0; n * c * h * w]
        } else if self.stride == 1 && self.padding < self.kernel {
            self.input_gradient_full_conv(&geo, [n, c, h, w], group, &grad_output.data)
        } else {
            self.input_gradient_col2im(&geo, [n, c, h, w], group, &grad_output.data)
        };
        Tensor::from_vec(&[n, c, h, w], grad_input)
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

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    #[test]
    fn grouped_batch_matches_image_by_image() {
        // 6×6 outputs: groups of 4 images (4·36 is a multiple of 16), so a batch of 5
        // runs as a full group and a partial one.
        let (n, c, o, side) = (5, 2, 3, 6);
        let mut batched = conv(c, o, 3, 1, 1, 21);
        let geo = batched.geometry(side, side);
        assert_eq!(batched.group_images(&geo, n), 4);
        let image_len = c * side * side;
        let out_len = o * side * side;
        let input = Tensor::from_vec(&[n, c, side, side], pseudo_random(n * image_len, 4));
        let out = batched.forward(&input, true);
        let grad = Tensor::from_vec(&out.shape, pseudo_random(out.len(), 6));
        let grad_in = batched.backward(&grad);
        // A second backward overwrites (does not add to) the parameter gradients.
        let first_grads: Vec<Vec<f32>> = batched.params.iter().map(|p| p.grad.clone()).collect();
        assert_eq!(batched.backward(&grad), grad_in);
        for (p, first) in batched.params.iter().zip(&first_grads) {
            assert_eq!(&p.grad, first, "{} after a second backward", p.name);
        }

        let mut single = conv(c, o, 3, 1, 1, 21);
        let mut param_grads: Vec<Vec<f32>> =
            single.params.iter().map(|p| vec![0.0; p.len()]).collect();
        for i in 0..n {
            let image = &input.data[i * image_len..(i + 1) * image_len];
            let x = Tensor::from_vec(&[1, c, side, side], image.to_vec());
            let y = single.forward(&x, true);
            assert_close(&y.data, &out.data[i * out_len..(i + 1) * out_len], "output");
            let g = &grad.data[i * out_len..(i + 1) * out_len];
            let dx = single.backward(&Tensor::from_vec(&[1, o, side, side], g.to_vec()));
            let want = &grad_in.data[i * image_len..(i + 1) * image_len];
            assert_close(&dx.data, want, "input gradient");
            for (sum, p) in param_grads.iter_mut().zip(&single.params) {
                for (s, g) in sum.iter_mut().zip(&p.grad) {
                    *s += g;
                }
            }
        }
        for (sum, p) in param_grads.iter().zip(&batched.params) {
            assert_close(&p.grad, sum, &p.name);
        }
    }

    #[test]
    fn full_convolution_and_col2im_input_gradients_agree() {
        for (kernel, padding) in [(3, 1), (3, 0), (5, 2), (2, 1), (1, 0)] {
            let mut layer = conv(2, 3, kernel, 1, padding, 9);
            let shape = [3, 2, 7, 6];
            let input = Tensor::from_vec(&shape, pseudo_random(3 * 2 * 7 * 6, 2));
            let out = layer.forward(&input, true);
            let grad = pseudo_random(out.len(), 3);
            let geo = layer.geometry(7, 6);
            let group = layer.group_images(&geo, 3);
            let full = layer.input_gradient_full_conv(&geo, shape, group, &grad);
            let scattered = layer.input_gradient_col2im(&geo, shape, group, &grad);
            assert_close(&full, &scattered, "input gradient");
        }
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
