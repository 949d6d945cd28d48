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
//! 2. **Overlap.** A libtorch replica (`mlp`, `resnet20`) on `cuda:0` runs the staged backward;
//!    the moment a unit is handed over it takes its optimizer step and its parameters are
//!    all-reduced (AVG, as `dreamddp` does) on the communication stream after an event on the
//!    compute stream; the next step's compute waits on each unit's event. CUDA events give,
//!    per step, when each unit's all-reduce started and ended against when backward ended:
//!    the share of communication time hidden behind backward, and how many all-reduces
//!    started before backward ended. Every unit is synced every step (H = 1, the most
//!    communication); with one GPU NCCL's all-reduce is a local pass over the buffer.
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
    /// Share of all-reduce time that ran before backward ended.
    pub hidden_share: f64,
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
    use engine::replica::{DeviceSpan, DeviceSpans};
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
        let buffers: Vec<Vec<DeviceBuffer>> = (0..replica.layer_names().len())
            .map(|i| {
                replica
                    .unit_value_buffers(i)
                    .into_iter()
                    .map(|(ptr, len)| DeviceBuffer { ptr, len })
                    .collect()
            })
            .collect();
        let params: usize = buffers.iter().flatten().map(|b| b.len).sum();
        let units = buffers.iter().filter(|b| !b.is_empty()).count();
        let rank = NcclRank::init_all(&[0])?.pop().context("one rank")?;
        let lr = 0.01;
        let mut row = OverlapRow {
            model: model.into(),
            units,
            params,
            compute_ms: 0.0,
            comm_ms: 0.0,
            hidden_share: 0.0,
            started_before_backward_end: 0,
            all_reduces: 0,
            step_ms_with_nccl: 0.0,
            step_ms_without: 0.0,
        };
        let (mut hidden, mut comm, mut compute) = (0.0f64, 0.0f64, 0.0f64);
        for step in 0..(5 + steps) {
            let measured = step >= 5;
            // Without NCCL: the same step, interleaved.
            let t0 = Instant::now();
            replica.forward_backward(&input, &targets, &mut |_, u| u.step(lr))?;
            replica.synchronize_device();
            let without = t0.elapsed().as_secs_f64() * 1e3;
            // With NCCL.
            let t0 = Instant::now();
            let base = rank.mark_compute(true)?;
            let mut pending = Vec::new();
            let mut last_ready = None;
            let mut failure = None;
            replica.forward_backward(&input, &targets, &mut |i, u| {
                u.step(lr);
                if failure.is_some() {
                    return;
                }
                let launched = rank.mark_compute(true).and_then(|ready| {
                    last_ready = Some(ready);
                    // SAFETY: the unit's value tensors live in `replica`, which outlives the
                    // wait below; nothing else writes them until the compute stream waited.
                    unsafe { rank.launch(&buffers[i], ReductionOp::Avg, true) }
                });
                match launched {
                    Ok(p) => pending.push(p),
                    Err(e) => failure = Some(e),
                }
            })?;
            if let Some(e) = failure {
                return Err(e.into());
            }
            for p in &pending {
                p.order_compute()?;
            }
            replica.synchronize_device();
            let with = t0.elapsed().as_secs_f64() * 1e3;
            if !measured {
                continue;
            }
            let ready = last_ready.context("no unit was handed over")?;
            let bw_end = f64::from(
                base.elapsed_ms(&ready)
                    .map_err(|e| anyhow!("event: {e:?}"))?,
            );
            compute += bw_end;
            for p in &pending {
                let t = p.timing(&base)?.context("timed launch")?;
                let dur = (t.end_ms - t.start_ms).max(0.0);
                comm += dur;
                hidden += (bw_end.min(t.end_ms) - t.start_ms).clamp(0.0, dur);
                row.all_reduces += 1;
                if t.start_ms < bw_end {
                    row.started_before_backward_end += 1;
                }
            }
            row.step_ms_with_nccl += with / steps as f64;
            row.step_ms_without += without / steps as f64;
        }
        row.compute_ms = compute / steps as f64;
        row.comm_ms = comm / steps as f64;
        row.hidden_share = if comm > 0.0 { hidden / comm } else { 1.0 };
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
                 {:.1} % hidden behind backward, {}/{} started before backward ended; step {:.3} ms \
                 with NCCL vs {:.3} ms without",
                row.model,
                row.units,
                row.params,
                row.compute_ms,
                row.comm_ms,
                row.hidden_share * 100.0,
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
