//! ResNet-20 in the CIFAR style (He et al. 2016, §4.2) with BatchNorm: the constructor
//! [`TchReplica::resnet20`], its deterministic initialization, and the stem / basic-block /
//! head forward ops.
//!
//! Layout (PyTorch `state_dict` names of the equivalent module, e.g. akamaster's
//! `resnet_cifar.py` with option A):
//!
//! * `stem` unit: `conv1` (3x3, 16 channels, stride 1, no bias) → `bn1` → ReLU;
//! * units `layer{1,2,3}.{0,1,2}`: basic blocks `conv1` → `bn1` → ReLU → `conv2` → `bn2`,
//!   plus the shortcut, then ReLU; 16/32/64 channels, stride 2 in the first block of stages 2
//!   and 3;
//! * `fc` unit: global average pool → `fc` (linear, `classes` outputs).
//!
//! Shortcuts are **option A** (the paper's CIFAR choice): identity, and where the shape
//! changes, subsample by 2 (`x[:, :, ::2, ::2]`) and zero-pad the new channels equally on
//! both sides. They are parameter-free, so the model has 0.27M parameters as in the paper.
//!
//! Every BatchNorm has `weight`/`bias` (parameters), `running_mean`/`running_var` (synced
//! buffers: part of its unit's flat vectors) and `num_batches_tracked` (kept per replica).
//! Training uses batch statistics and updates the running ones with momentum 0.1; evaluation
//! uses the running statistics (eps 1e-5, as `nn.BatchNorm2d`).

use std::cell::RefCell;

use engine::model::LayerInfo;
use engine::optim::OptimizerConfig;
use tch::{Device, Kind, TchError, Tensor};

use super::device::{configure_threads, parse_device};
use super::ops::Op;
use super::replica::{Net, Stage, TchReplica};
use super::unit::{TchBuffer, TchParam, TchUnit};
use super::{inplace, torch_error};
use crate::TchBackendError;

const BN_MOMENTUM: f64 = 0.1;
const BN_EPS: f64 = 1e-5;

/// SplitMix64 with Box–Muller normals: a small deterministic generator (same seed, same
/// weights on every machine and device; values are made on the host).
struct InitRng(u64);

impl InitRng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self, len: usize, std: f64) -> Vec<f32> {
        (0..len)
            .map(|_| {
                let (u1, u2) = (self.uniform(), self.uniform());
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (z * std) as f32
            })
            .collect()
    }

    fn uniform_in(&mut self, len: usize, bound: f64) -> Vec<f32> {
        (0..len)
            .map(|_| ((self.uniform() * 2.0 - 1.0) * bound) as f32)
            .collect()
    }
}

/// Builds one unit's tensors in `state_dict` order.
struct UnitBuilder<'a> {
    prefix: String,
    rng: &'a mut InitRng,
    optimizer: &'a OptimizerConfig,
    device: Device,
    params: Vec<TchParam>,
    buffers: Vec<TchBuffer>,
}

impl UnitBuilder<'_> {
    fn name(&self, local: &str) -> String {
        if self.prefix.is_empty() {
            local.to_string()
        } else {
            format!("{}.{local}", self.prefix)
        }
    }

    fn param(&mut self, local: &str, values: &[f32], shape: &[usize]) -> Result<(), TchError> {
        let name = self.name(local);
        let p = TchParam::from_host(name, values, shape, self.optimizer, self.device)?;
        self.params.push(p);
        Ok(())
    }

    /// Kaiming-normal, `mode="fan_out"`, `nonlinearity="relu"` (torchvision's ResNet init).
    fn conv(&mut self, local: &str, out_ch: usize, in_ch: usize) -> Result<(), TchError> {
        let std = (2.0 / (out_ch * 9) as f64).sqrt();
        let values = self.rng.normal(out_ch * in_ch * 9, std);
        self.param(&format!("{local}.weight"), &values, &[out_ch, in_ch, 3, 3])
    }

    /// Weight 1, bias 0, running mean 0, running var 1, no batches tracked.
    fn bn(&mut self, local: &str, ch: usize) -> Result<(), TchError> {
        self.param(&format!("{local}.weight"), &vec![1.0; ch], &[ch])?;
        self.param(&format!("{local}.bias"), &vec![0.0; ch], &[ch])?;
        let c = [ch as i64];
        for (buffer, fill, kind, shape, synced) in [
            ("running_mean", 0.0, Kind::Float, &c[..], true),
            ("running_var", 1.0, Kind::Float, &c[..], true),
            ("num_batches_tracked", 0.0, Kind::Int64, &[][..], false),
        ] {
            let name = self.name(&format!("{local}.{buffer}"));
            let b = TchBuffer::filled(name, shape, fill, kind, synced, self.device)?;
            self.buffers.push(b);
        }
        Ok(())
    }

    /// `nn.Linear`'s default: weight and bias uniform in ±1/√fan_in.
    fn linear(&mut self, local: &str, out_f: usize, in_f: usize) -> Result<(), TchError> {
        let bound = 1.0 / (in_f as f64).sqrt();
        let w = self.rng.uniform_in(out_f * in_f, bound);
        let b = self.rng.uniform_in(out_f, bound);
        self.param(&format!("{local}.weight"), &w, &[out_f, in_f])?;
        self.param(&format!("{local}.bias"), &b, &[out_f])
    }

    fn finish(self) -> TchUnit {
        let mut unit = TchUnit::new(self.params, self.optimizer);
        unit.buffers = self.buffers;
        unit
    }
}

impl TchReplica {
    /// ResNet-20 in the CIFAR style (He et al. 2016 §4.2) for `[N, in_ch, height, width]`
    /// inputs (28×28 grayscale, 32×32 colour, or any size ≥ 4) with `classes` outputs on
    /// `device`, its weights drawn deterministically from `seed` (Kaiming-normal fan-out convs,
    /// BatchNorm 1/0, `nn.Linear`'s uniform head), a fresh `optimizer` per unit.
    ///
    /// Units, in forward order: `stem` (`conv1`, `bn1`), the basic blocks `layer1.0` …
    /// `layer3.2` (16/32/64 channels, stride 2 first in stages 2 and 3, option-A shortcuts:
    /// subsample and zero-pad channels, no parameters), `fc` (global average pool, linear).
    /// Tensor names are the equivalent PyTorch module's `state_dict` names. A unit's flat values
    /// are its parameters then its BatchNorm `running_mean`/`running_var`; its gradients have
    /// zeros in those slots; `num_batches_tracked` stays per replica. Training uses batch
    /// statistics (running ones updated with momentum 0.1), `logits` the running statistics.
    ///
    /// # Errors
    /// [`TchBackendError::InvalidConfig`] for zero channels/classes or inputs under 4×4, a bad
    /// or unusable device, a libtorch error.
    pub fn resnet20(
        in_ch: usize,
        height: usize,
        width: usize,
        classes: usize,
        seed: u64,
        optimizer: &OptimizerConfig,
        device: &str,
    ) -> Result<TchReplica, TchBackendError> {
        Self::resnet_cifar(3, in_ch, height, width, classes, seed, optimizer, device)
    }

    /// The CIFAR ResNet family (6n+2 layers, `blocks` = n per stage); n = 3 is ResNet-20.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn resnet_cifar(
        blocks: usize,
        in_ch: usize,
        height: usize,
        width: usize,
        classes: usize,
        seed: u64,
        optimizer: &OptimizerConfig,
        device: &str,
    ) -> Result<TchReplica, TchBackendError> {
        if in_ch == 0 || classes == 0 || height < 4 || width < 4 || blocks == 0 {
            return Err(TchBackendError::InvalidConfig(format!(
                "resnet: need ≥ 1 input channel, ≥ 1 class, ≥ 1 block per stage and inputs of at \
                 least 4×4, got {in_ch} channel(s), {classes} class(es), {blocks} block(s), \
                 {height}×{width}"
            )));
        }
        let device = parse_device(device)?;
        configure_threads(device);
        let mut rng = InitRng(seed);
        let mut names = Vec::new();
        let mut units = Vec::new();
        let mut stages = Vec::new();
        let mut infos = Vec::new();
        let mut push = |name: String, kind: &'static str, unit: TchUnit, op: Op| {
            let index = names.len();
            infos.push(LayerInfo {
                index,
                name: name.clone(),
                kind,
                params: unit.len(),
            });
            names.push(name);
            units.push(Some(unit));
            stages.push(Stage {
                unit: index,
                ops: vec![op],
            });
        };
        let build = |prefix: &str,
                     rng: &mut InitRng,
                     f: &dyn Fn(&mut UnitBuilder) -> Result<(), TchError>| {
            let mut b = UnitBuilder {
                prefix: prefix.to_string(),
                rng,
                optimizer,
                device,
                params: Vec::new(),
                buffers: Vec::new(),
            };
            f(&mut b).map_err(torch_error)?;
            Ok::<_, TchBackendError>(b.finish())
        };
        let stem = build("", &mut rng, &|b| {
            b.conv("conv1", 16, in_ch)?;
            b.bn("bn1", 16)
        })?;
        push("stem".into(), "resnet_stem", stem, Op::ResStem);
        let mut in_planes = 16;
        for (stage, planes) in [16usize, 32, 64].into_iter().enumerate() {
            for block in 0..blocks {
                let stride = if stage > 0 && block == 0 { 2 } else { 1 };
                let prefix = format!("layer{}.{block}", stage + 1);
                let unit = build(&prefix, &mut rng, &|b| {
                    b.conv("conv1", planes, in_planes)?;
                    b.bn("bn1", planes)?;
                    b.conv("conv2", planes, planes)?;
                    b.bn("bn2", planes)
                })?;
                let op = Op::ResBlock {
                    stride,
                    in_planes: in_planes as i64,
                    planes: planes as i64,
                };
                push(prefix, "basic_block", unit, op);
                in_planes = planes;
            }
        }
        let head = build("", &mut rng, &|b| b.linear("fc", classes, 64))?;
        push("fc".into(), "linear", head, Op::ResHead);
        Ok(TchReplica {
            device,
            names,
            infos,
            net: Net::Staged {
                prefix: Vec::new(),
                stages,
            },
            units,
            deferred: RefCell::new(None),
            input_shape: Some(vec![in_ch, height, width]),
        })
    }
}

fn conv3x3(x: &Tensor, w: &Tensor, stride: i64) -> Result<Tensor, TchError> {
    x.f_conv2d(w, None::<&Tensor>, [stride, stride], [1, 1], [1, 1], 1)
}

/// BatchNorm with the unit's parameters `p`, `p+1` and buffers `b..b+3`.
fn batch_norm(
    x: &Tensor,
    unit: &TchUnit,
    p: usize,
    b: usize,
    train: bool,
) -> Result<Tensor, TchError> {
    let (params, buffers) = (&unit.params, &unit.buffers);
    let y = x.f_batch_norm(
        Some(&params[p].value),
        Some(&params[p + 1].value),
        Some(&buffers[b].value),
        Some(&buffers[b + 1].value),
        train,
        BN_MOMENTUM,
        BN_EPS,
        true,
    )?;
    if train {
        let _guard = tch::no_grad_guard();
        inplace(buffers[b + 2].value.shallow_clone().f_add_scalar_(1))?;
    }
    Ok(y)
}

/// conv1 → bn1 → ReLU.
pub(super) fn stem(x: &Tensor, unit: &TchUnit, train: bool) -> Result<Tensor, TchError> {
    let y = conv3x3(x, &unit.params[0].value, 1)?;
    batch_norm(&y, unit, 1, 0, train)?.f_relu()
}

/// relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), option-A shortcut.
pub(super) fn block(
    x: &Tensor,
    unit: &TchUnit,
    stride: i64,
    in_planes: i64,
    planes: i64,
    train: bool,
) -> Result<Tensor, TchError> {
    let y = conv3x3(x, &unit.params[0].value, stride)?;
    let y = batch_norm(&y, unit, 1, 0, train)?.f_relu()?;
    let y = conv3x3(&y, &unit.params[3].value, 1)?;
    let y = batch_norm(&y, unit, 4, 3, train)?;
    let mut shortcut = x.shallow_clone();
    if stride != 1 {
        shortcut = shortcut
            .f_slice(2, 0, None, stride)?
            .f_slice(3, 0, None, stride)?;
    }
    if in_planes != planes {
        let lo = (planes - in_planes) / 2;
        let hi = planes - in_planes - lo;
        shortcut = shortcut.f_constant_pad_nd([0, 0, 0, 0, lo, hi])?;
    }
    y.f_add(&shortcut)?.f_relu()
}

/// Global average pool → fc.
pub(super) fn head(x: &Tensor, unit: &TchUnit) -> Result<Tensor, TchError> {
    x.f_mean_dim(&[2i64, 3][..], false, Kind::Float)?
        .f_linear(&unit.params[0].value, Some(&unit.params[1].value))
}
