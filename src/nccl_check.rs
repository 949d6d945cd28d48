//! `dreamddp nccl-check`: the GPU half of issue 10 measured on whatever GPUs this machine has
//! (built with `--features tch,nccl`; elsewhere it says what it needs and stops).
//!
//! 1. **Correctness.** One rank per visible GPU, one thread per rank. Each rank fills libtorch
//!    CUDA tensors with its own seeded values; [`NcclRank::launch`] all-reduces them in place
//!    (SUM, then AVG) straight from the tensors' `data_ptr` (no copies), and the results are
//!    compared with a CPU reference in `f64` (normwise relative error; goal ≤ 1e-6). The
//!    trainer's two paths through [`NcclCollective`] are checked the same way: host-staged
//!    vectors, and the device path (buckets built in GPU memory from tensors, a slot with no
//!    memory and host values, landed back into tensors).
//! 2. **Overlap.** A libtorch replica (`mlp`, `resnet20`) on `cuda:0` runs the staged backward
//!    and syncs its units as the trainer's device path runs `dreamddp` with every unit due
//!    every step (H = 1, the most communication): at a unit's hand-over the bucket launched
//!    one step earlier is landed (the compute stream waits on it, the average is copied back),
//!    the unit takes its optimizer step, its parameters are copied into its bucket and the
//!    bucket's all-reduce (AVG) starts on the communication stream after an event on the
//!    compute stream. The next forward reads the unit's own values meanwhile. CUDA events
//!    give when each all-reduce started and ended against when the compute stream needed it
//!    (the unit's next optimizer step) and when its step's backward ended: the share of
//!    communication time hidden behind compute, the share hidden behind the same backward,
//!    and how many all-reduces started before backward ended. With one GPU NCCL's
//!    all-reduce is a local pass over the buffer.
//!
//! Writes one JSON report (`--out`) and prints a summary.

use anyhow::{bail, Result};
use clap::Args;
#[cfg(all(feature = "tch", feature = "nccl"))]
use serde::Serialize;

/// Flags of `nccl-check`.
#[derive(Args, Debug, Clone)]
pub struct NcclCheckArgs {
    /// Models for the overlap measurement (mlp, resnet20).
    #[arg(long, default_value = "mlp,resnet20")]
    pub models: String,
    /// Measured steps per model (after 5 warm-up steps).
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Batch size of the overlap runs.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// Where to write the JSON report.
    #[arg(long, default_value = "nccl-check.json")]
    pub out: std::path::PathBuf,
}

/// One correctness case.
#[cfg(all(feature = "tch", feature = "nccl"))]
#[derive(Debug, Serialize)]
pub struct CorrectnessRow {
    /// `device-sum`, `device-avg` (in place on tensors), `host-staged-avg` (the trainer's
    /// host path) or `device-path-avg` (the trainer's device path: tensors, a gap, host values).
    pub case: String,
    /// Ranks (GPUs).
    pub world: usize,
    /// Elements per rank.
    pub elements: usize,
    /// max |nccl − reference| / max |reference| over every rank's result.
    pub rel_error: f64,
}

/// One model's overlap measurement.
#[cfg(all(feature = "tch", feature = "nccl"))]
#[derive(Debug, Serialize)]
pub struct OverlapRow {
    /// Model.
    pub model: String,
    /// Units (all-reduces per step).
    pub units: usize,
    /// Parameters all-reduced per step.
    pub params: usize,
    /// Mean forward + backward (with the per-unit steps), ms, from the step's start event to
    /// the last unit's ready event.
    pub compute_ms: f64,
    /// Mean summed all-reduce time per step, ms.
    pub comm_ms: f64,
    /// Share of all-reduce time that ran while the compute stream still had work before it
    /// needed the result (the unit's next optimizer step): hidden behind compute.
    pub hidden_share: f64,
    /// Share of all-reduce time that ran before the launching step's backward ended.
    pub hidden_in_backward_share: f64,
    /// All-reduces that started before backward ended, over all measured steps.
    pub started_before_backward_end: usize,
    /// All-reduces measured.
    pub all_reduces: usize,
    /// Mean wall time of a step with the all-reduces, ms.
    pub step_ms_with_nccl: f64,
    /// Mean wall time of the same step without them (same run, interleaved), ms.
    pub step_ms_without: f64,
}

/// The whole report.
#[cfg(all(feature = "tch", feature = "nccl"))]
#[derive(Debug, Serialize)]
pub struct NcclCheckReport {
    /// GPUs seen and NCCL's version.
    pub devices: usize,
    /// NCCL version string.
    pub nccl_version: String,
    /// Correctness cases.
    pub correctness: Vec<CorrectnessRow>,
    /// Overlap per model.
    pub overlap: Vec<OverlapRow>,
}

/// Runs the check.
pub fn run(args: NcclCheckArgs) -> Result<()> {
    imp::run(args)
}

#[cfg(not(all(feature = "tch", feature = "nccl")))]
mod imp {
    use super::*;

    pub fn run(_args: NcclCheckArgs) -> Result<()> {
        bail!(
            "nccl-check needs a binary built with --features tch,nccl (libtorch with CUDA and \
             NCCL; see docs/gpu.md)"
        )
    }
}

#[cfg(all(feature = "tch", feature = "nccl"))]
mod imp {
    use std::time::Instant;

    use anyhow::{anyhow, Context};
    use engine::optim::OptimizerConfig;
    use engine::replica::ModelReplica;
    use engine::replica::{DeviceSpan, DeviceSpans, UnitData};
    use engine::tensor::Tensor as HostTensor;
    use gpu_worker::device_sync::{DeviceCollective, StagedPiece};
    use gpu_worker::nccl::{DeviceBuffer, NcclCollective, NcclRank, ReductionOp};
    use node::collective::{Collective, ReduceKey};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use tch_backend::tch::{Device, Tensor};
    use tch_backend::TchReplica;

    use super::*;

    const SIZES: [usize; 3] = [1, 4099, 1 << 20];

    fn rank_values(rank: usize, len: usize) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(1000 + rank as u64 * 7919 + len as u64);
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn rel_error(got: &[f32], want: &[f64]) -> f64 {
        if got.len() != want.len() {
            return f64::INFINITY;
        }
        let scale = want
            .iter()
            .fold(0.0f64, |m, v| m.max(v.abs()))
            .max(f64::MIN_POSITIVE);
        let worst = got
            .iter()
            .zip(want)
            .fold(0.0f64, |m, (g, w)| m.max((f64::from(*g) - w).abs()));
        worst / scale
    }

    fn reference(world: usize, len: usize, op: ReductionOp) -> Vec<f64> {
        let mut sum = vec![0.0f64; len];
        for r in 0..world {
            for (s, v) in sum.iter_mut().zip(rank_values(r, len)) {
                *s += f64::from(v);
            }
        }
        if op == ReductionOp::Avg {
            sum.iter_mut().for_each(|s| *s /= world as f64);
        }
        sum
    }

    /// Every rank, one thread each, all-reduces its tensors in place; returns each rank's
    /// results.
    fn device_case(ranks: &mut [NcclRank], len: usize, op: ReductionOp) -> Result<Vec<Vec<f32>>> {
        std::thread::scope(|scope| {
            // `&mut`: each thread holds its rank exclusively (a communicator is not shared).
            let handles: Vec<_> = ranks
                .iter_mut()
                .map(|rank| {
                    scope.spawn(move || -> Result<Vec<f32>> {
                        let device = Device::Cuda(rank.device());
                        let t = Tensor::f_from_slice(&rank_values(rank.rank(), len))
                            .and_then(|t| t.f_to_device(device))
                            .map_err(|e| anyhow!("tensor on {device:?}: {e}"))?;
                        let buf = [DeviceBuffer {
                            ptr: t.data_ptr() as u64,
                            len,
                        }];
                        // SAFETY: `t` is a contiguous f32 CUDA tensor of `len` elements on this
                        // rank's device, alive until after the compute stream waited below.
                        let pending = unsafe { rank.launch(&buf, op, false) }?;
                        pending.order_compute()?;
                        let host = t
                            .f_to_device(Device::Cpu)
                            .map_err(|e| anyhow!("copy back: {e}"))?;
                        Vec::<f32>::try_from(&host).map_err(|e| anyhow!("copy back: {e}"))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| anyhow!("a rank thread panicked"))?)
                .collect()
        })
    }

    fn host_case(collective: &NcclCollective, len: usize) -> Result<Vec<Vec<f32>>> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..collective.world())
                .map(|r| {
                    scope.spawn(move || -> Result<Vec<f32>> {
                        let h = collective.all_reduce_mean(
                            r,
                            ReduceKey::new(0, 0),
                            rank_values(r, len),
                        )?;
                        Ok(h.wait()?)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| anyhow!("a rank thread panicked"))?)
                .collect()
        })
    }

    /// Values with no memory behind them and host values in the device-path case.
    const GAP: usize = 3;
    const HOST: usize = 5;

    /// Rank `r`'s input of the device-path case: `len` device values split over two tensors
    /// around a `GAP` of zeros (a slot with no memory), then `HOST` host values.
    fn device_path_input(rank: usize, len: usize) -> Vec<f32> {
        let mut v = rank_values(rank, len + GAP + HOST);
        v[len / 2..len / 2 + GAP].fill(0.0);
        v
    }

    /// The trainer's device path ([`DeviceCollective::launch_pieces`]): every rank stages two
    /// CUDA tensors, a gap and host values, lands the average into two fresh tensors and
    /// reads the host part back; returns each rank's whole result.
    fn device_path_case(collective: &NcclCollective, len: usize) -> Result<Vec<Vec<f32>>> {
        let spans = |a: &Tensor, b: &Tensor| DeviceSpans {
            device: 0,
            spans: vec![
                DeviceSpan {
                    ptr: Some(a.data_ptr() as u64),
                    len: len / 2,
                },
                DeviceSpan {
                    ptr: None,
                    len: GAP,
                },
                DeviceSpan {
                    ptr: Some(b.data_ptr() as u64),
                    len: len - len / 2,
                },
            ],
        };
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..collective.world())
                .map(|r| {
                    scope.spawn(move || -> Result<Vec<f32>> {
                        let device = Device::Cuda(collective.device_of(r));
                        let input = device_path_input(r, len);
                        let cuda = |v: &[f32]| {
                            Tensor::f_from_slice(v)
                                .and_then(|t| t.f_to_device(device))
                                .map_err(|e| anyhow!("tensor on {device:?}: {e}"))
                        };
                        let a = cuda(&input[..len / 2])?;
                        let b = cuda(&input[len / 2 + GAP..len + GAP])?;
                        let pieces = [
                            StagedPiece::Device(spans(&a, &b).range(0, len + GAP)),
                            StagedPiece::Host(input[len + GAP..].to_vec()),
                        ];
                        // SAFETY: `a` and `b` are contiguous f32 tensors on the rank's GPU,
                        // alive until after the compute stream waited on the landing.
                        let landing =
                            unsafe { collective.launch_pieces(r, ReduceKey::new(0, 0), &pieces) }?;
                        landing.order_compute()?;
                        let a2 = cuda(&vec![0.0; len / 2])?;
                        let b2 = cuda(&vec![0.0; len - len / 2])?;
                        // SAFETY: as above, for the fresh tensors.
                        unsafe {
                            landing.write_to_device(0, &spans(&a2, &b2).range(0, len + GAP))
                        }?;
                        let host_part = landing.read_to_host(len + GAP, HOST)?;
                        let back = |t: &Tensor| {
                            t.f_to_device(Device::Cpu)
                                .map_err(|e| anyhow!("copy back: {e}"))
                                .and_then(|h| {
                                    Vec::<f32>::try_from(&h).map_err(|e| anyhow!("copy back: {e}"))
                                })
                        };
                        let mut out = back(&a2)?;
                        out.extend(std::iter::repeat_n(0.0, GAP));
                        out.extend(back(&b2)?);
                        out.extend(host_part);
                        Ok(out)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| anyhow!("a rank thread panicked"))?)
                .collect()
        })
    }

    fn correctness(devices: usize) -> Result<Vec<CorrectnessRow>> {
        // Loads libtorch's CUDA backend (and checks every device) before any tensor is made.
        for d in 0..devices {
            tch_backend::check_device(&format!("cuda:{d}"))?;
        }
        let mut rows = Vec::new();
        {
            let mut ranks = NcclRank::init_all(&(0..devices).collect::<Vec<_>>())?;
            for len in SIZES {
                for (name, op) in [
                    ("device-sum", ReductionOp::Sum),
                    ("device-avg", ReductionOp::Avg),
                ] {
                    let got = device_case(&mut ranks, len, op)?;
                    let want = reference(devices, len, op);
                    let err = got.iter().map(|g| rel_error(g, &want)).fold(0.0, f64::max);
                    rows.push(CorrectnessRow {
                        case: name.into(),
                        world: devices,
                        elements: len,
                        rel_error: err,
                    });
                }
            }
        }
        let collective = NcclCollective::new(devices)?;
        for len in SIZES {
            let got = host_case(&collective, len)?;
            let want = reference(devices, len, ReductionOp::Avg);
            let err = got.iter().map(|g| rel_error(g, &want)).fold(0.0, f64::max);
            rows.push(CorrectnessRow {
                case: "host-staged-avg".into(),
                world: devices,
                elements: len,
                rel_error: err,
            });
            let got = device_path_case(&collective, len)?;
            let mut want = vec![0.0f64; len + GAP + HOST];
            for r in 0..devices {
                for (w, v) in want.iter_mut().zip(device_path_input(r, len)) {
                    *w += f64::from(v) / devices as f64;
                }
            }
            let err = got.iter().map(|g| rel_error(g, &want)).fold(0.0, f64::max);
            rows.push(CorrectnessRow {
                case: "device-path-avg".into(),
                world: devices,
                elements: len + GAP + HOST,
                rel_error: err,
            });
        }
        Ok(rows)
    }

    fn replica(model: &str) -> Result<(TchReplica, Vec<usize>)> {
        let sgd = OptimizerConfig::sgd();
        Ok(match model {
            "mlp" => {
                let net =
                    engine::models::mlp::mlp(784, engine::models::mlp::MLP_MNIST_HIDDEN, 10, 0);
                (TchReplica::from_model(&net, &sgd, "cuda:0")?, vec![784])
            }
            "resnet20" => (
                TchReplica::resnet20(3, 32, 32, 10, 0, &sgd, "cuda:0")?,
                vec![3, 32, 32],
            ),
            other => bail!("nccl-check: unknown model '{other}' (mlp, resnet20)"),
        })
    }

    /// Copies `len` f32s from `src` to `dst` on `rank`'s compute stream.
    fn copy_on_compute(rank: &NcclRank, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: both are device memory of the rank's GPU holding `len` f32s (the unit
        // tensors of the replica and the bucket tensors, alive for the whole measurement).
        Ok(unsafe { rank.copy_on_compute(dst, src, len) }?)
    }

    /// One unit's bucket in flight: its launch and when its step's backward ended (ms after
    /// the base event).
    struct InFlightUnit {
        pending: gpu_worker::nccl::PendingDeviceReduce,
        backward_end_ms: f64,
    }

    fn overlap(model: &str, steps: usize, batch: usize) -> Result<OverlapRow> {
        let (mut replica, sample_shape) = replica(model)?;
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let sample: usize = sample_shape.iter().product();
        let shape: Vec<usize> = std::iter::once(batch).chain(sample_shape).collect();
        let input = HostTensor::from_vec(
            &shape,
            (0..batch * sample)
                .map(|_| rng.random_range(0.0f32..1.0))
                .collect(),
        );
        let targets: Vec<usize> = (0..batch).map(|_| rng.random_range(0..10)).collect();
        // Each unit's value tensors in device memory (empty for a parameter-free layer).
        let tensors: Vec<Vec<DeviceBuffer>> = (0..replica.layer_names().len())
            .map(|i| {
                let mut runs = Vec::new();
                replica.with_unit(i, &mut |u| {
                    let spans = u.device_spans(UnitData::Values).map(|d| d.spans);
                    runs = spans.unwrap_or_default();
                });
                runs.into_iter()
                    .filter_map(|s| s.ptr.map(|ptr| DeviceBuffer { ptr, len: s.len }))
                    .collect()
            })
            .collect();
        // One bucket per unit, as the trainer's device path builds it (a copy of the unit's
        // parameters: the next forward reads the unit's own values meanwhile).
        let buckets: Vec<Tensor> = tensors
            .iter()
            .map(|t| {
                let n: usize = t.iter().map(|b| b.len).sum();
                Tensor::f_zeros([n as i64], (tch_backend::tch::Kind::Float, Device::Cuda(0)))
                    .map_err(|e| anyhow!("bucket: {e}"))
            })
            .collect::<Result<_>>()?;
        let params: usize = tensors.iter().flatten().map(|b| b.len).sum();
        let units = tensors.iter().filter(|b| !b.is_empty()).count();
        let rank = NcclRank::init_all(&[0])?.pop().context("one rank")?;
        let lr = 0.01;
        let mut row = OverlapRow {
            model: model.into(),
            units,
            params,
            compute_ms: 0.0,
            comm_ms: 0.0,
            hidden_share: 0.0,
            hidden_in_backward_share: 0.0,
            started_before_backward_end: 0,
            all_reduces: 0,
            step_ms_with_nccl: 0.0,
            step_ms_without: 0.0,
        };
        let (mut hidden, mut hidden_in_backward, mut comm, mut compute) =
            (0.0f64, 0.0f64, 0.0f64, 0.0f64);
        let base = rank.mark_compute(true)?;
        let mut in_flight: Vec<Option<InFlightUnit>> = (0..tensors.len()).map(|_| None).collect();
        for step in 0..(5 + steps) {
            let measured = step >= 5;
            // Without NCCL: the same step, interleaved.
            let t0 = Instant::now();
            replica.forward_backward(&input, &targets, &mut |_, u| u.step(lr))?;
            replica.synchronize_device();
            let without = t0.elapsed().as_secs_f64() * 1e3;
            // With NCCL, as the trainer runs dreamddp with every unit due every step: at a
            // unit's hand-over, land its bucket from the previous step (the compute stream
            // waits on it, the average is copied back), step it, copy it into its bucket and
            // launch the bucket's all-reduce.
            let t0 = Instant::now();
            let step_start = rank.mark_compute(true)?;
            let mut launched = Vec::new();
            let mut landed = Vec::new();
            let mut last_ready = None;
            let mut failure: Option<anyhow::Error> = None;
            replica.forward_backward(&input, &targets, &mut |i, u| {
                if failure.is_some() || tensors[i].is_empty() {
                    u.step(lr);
                    return;
                }
                let r = (|| -> Result<()> {
                    if let Some(prev) = in_flight[i].take() {
                        let needed = rank.mark_compute(true)?;
                        prev.pending.order_compute()?;
                        let mut at = 0u64;
                        for t in &tensors[i] {
                            copy_on_compute(
                                &rank,
                                t.ptr,
                                buckets[i].data_ptr() as u64 + at,
                                t.len,
                            )?;
                            at += (t.len * 4) as u64;
                        }
                        landed.push((prev, needed));
                    }
                    u.step(lr);
                    let mut at = 0u64;
                    for t in &tensors[i] {
                        copy_on_compute(&rank, buckets[i].data_ptr() as u64 + at, t.ptr, t.len)?;
                        at += (t.len * 4) as u64;
                    }
                    let bucket = [DeviceBuffer {
                        ptr: buckets[i].data_ptr() as u64,
                        len: tensors[i].iter().map(|t| t.len).sum(),
                    }];
                    last_ready = Some(rank.mark_compute(true)?);
                    // SAFETY: the bucket tensor lives until the end of this function, after
                    // every all-reduce was waited on; it is touched only by these copies,
                    // ordered by the launch's events.
                    launched.push((i, unsafe { rank.launch(&bucket, ReductionOp::Avg, true) }?));
                    Ok(())
                })();
                if let Err(e) = r {
                    failure = Some(e);
                }
            })?;
            if let Some(e) = failure {
                return Err(e);
            }
            let backward_end = last_ready.context("no unit was handed over")?;
            replica.synchronize_device();
            let with = t0.elapsed().as_secs_f64() * 1e3;
            for (f, needed) in landed.into_iter().filter(|_| measured) {
                let t = f.pending.timing(&base)?.context("timed launch")?;
                let need = f64::from(
                    base.elapsed_ms(&needed)
                        .map_err(|e| anyhow!("event: {e:?}"))?,
                );
                let dur = (t.end_ms - t.start_ms).max(0.0);
                comm += dur;
                hidden += (need.min(t.end_ms) - t.start_ms).clamp(0.0, dur);
                hidden_in_backward +=
                    (f.backward_end_ms.min(t.end_ms) - t.start_ms).clamp(0.0, dur);
                row.all_reduces += 1;
                if t.start_ms < f.backward_end_ms {
                    row.started_before_backward_end += 1;
                }
            }
            if measured {
                compute += f64::from(
                    step_start
                        .elapsed_ms(&backward_end)
                        .map_err(|e| anyhow!("event: {e:?}"))?,
                );
                row.step_ms_with_nccl += with / steps as f64;
                row.step_ms_without += without / steps as f64;
            }
            let backward_end_ms = f64::from(
                base.elapsed_ms(&backward_end)
                    .map_err(|e| anyhow!("event: {e:?}"))?,
            );
            for (i, pending) in launched {
                in_flight[i] = Some(InFlightUnit {
                    pending,
                    backward_end_ms,
                });
            }
        }
        // The buckets still in flight finish before the bucket tensors are dropped.
        for f in in_flight.into_iter().flatten() {
            f.pending.synchronize()?;
        }
        row.compute_ms = compute / steps as f64;
        row.comm_ms = comm / steps as f64;
        row.hidden_share = if comm > 0.0 { hidden / comm } else { 1.0 };
        row.hidden_in_backward_share = if comm > 0.0 {
            hidden_in_backward / comm
        } else {
            1.0
        };
        Ok(row)
    }

    pub fn run(args: NcclCheckArgs) -> Result<()> {
        let info = crate::train_cmd::probe_restarting().map_err(|e| anyhow!("nccl-check: {e}"))?;
        println!(
            "nccl-check: {} GPU(s), NCCL {}",
            info.devices,
            info.version_string()
        );
        let correctness = correctness(info.devices)?;
        for r in &correctness {
            println!(
                "  correctness {:<16} world {} elements {:>8}: relative error {:.2e} ({})",
                r.case,
                r.world,
                r.elements,
                r.rel_error,
                if r.rel_error <= 1e-6 {
                    "ok"
                } else {
                    "ABOVE 1e-6"
                }
            );
        }
        let mut overlap_rows = Vec::new();
        for model in args
            .models
            .split(',')
            .map(str::trim)
            .filter(|m| !m.is_empty())
        {
            let row = overlap(model, args.steps.max(1), args.batch.max(1))?;
            println!(
                "  overlap {:<9} {} units, {} params: compute {:.3} ms, all-reduce {:.3} ms/step, \
                 {:.1} % hidden behind compute ({:.1} % behind the same backward), {}/{} started \
                 before backward ended; step {:.3} ms with NCCL vs {:.3} ms without",
                row.model,
                row.units,
                row.params,
                row.compute_ms,
                row.comm_ms,
                row.hidden_share * 100.0,
                row.hidden_in_backward_share * 100.0,
                row.started_before_backward_end,
                row.all_reduces,
                row.step_ms_with_nccl,
                row.step_ms_without
            );
            overlap_rows.push(row);
        }
        let report = NcclCheckReport {
            devices: info.devices,
            nccl_version: info.version_string(),
            correctness,
            overlap: overlap_rows,
        };
        std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("cannot write {}", args.out.display()))?;
        println!("report: {}", args.out.display());
        Ok(())
    }
}
