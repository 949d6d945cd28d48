//! Which training samples a process holds and how each of its ranks draws from them.
//!
//! With [`DataPartition::Reshuffled`] (the default, PyTorch's `DistributedSampler`) every
//! process holds the whole training set, because each epoch deals a new permutation of it.
//! With [`DataPartition::Fixed`] each rank owns its epoch-0 shard for the run, as a device owns
//! its data, so a process needs only its own ranks' samples: [`load_fixed_shards`] reads
//! just those (MNIST's images are streamed and the rest skipped), and an edge agent of a
//! 34-rank cluster holds 1.4 MB of MNIST instead of 47 MB.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use engine::data::sampler::{fixed_shard, DataPartition, ShardedSampler};
use engine::data::{DataError, TrainTest};

use crate::task::{load_data, TaskData};

/// How a task's training samples are dealt to ranks, and which of them the process holds.
#[derive(Clone, Debug, Default)]
pub struct Sampling {
    /// How the samples are dealt out from one epoch to the next.
    pub partition: DataPartition,
    /// `Some`: the process holds only these samples of the full training set (ascending
    /// indices into it, in the order held) and `full_len` is that set's size.
    held: Option<Arc<[usize]>>,
    full_len: usize,
}

impl Sampling {
    /// The whole training set, dealt out as `partition` says.
    pub fn whole(partition: DataPartition) -> Self {
        Self {
            partition,
            held: None,
            full_len: 0,
        }
    }

    /// The sampler of rank `rank` of `world` over the `held_len` samples the task holds.
    /// Errors when the rank's samples are not held (a subset loaded for other ranks, or one
    /// that cannot be reshuffled).
    pub fn sampler(
        &self,
        held_len: usize,
        rank: usize,
        world: usize,
        seed: u64,
    ) -> Result<ShardedSampler, DataError> {
        match (self.partition, &self.held) {
            (DataPartition::Reshuffled, None) => {
                ShardedSampler::new(held_len, rank, world, seed, true)
            }
            (DataPartition::Reshuffled, Some(_)) => Err(DataError::InvalidSampler(
                "this process holds only its fixed shards: they cannot be reshuffled over the \
                 whole training set"
                    .into(),
            )),
            (DataPartition::Fixed, None) => {
                ShardedSampler::fixed(fixed_shard(held_len, rank, world, seed)?, rank, seed)
            }
            (DataPartition::Fixed, Some(held)) => {
                let own = fixed_shard(self.full_len, rank, world, seed)?;
                let local = own
                    .iter()
                    .map(|global| held.binary_search(global))
                    .collect::<Result<Vec<usize>, usize>>()
                    .map_err(|_| {
                        DataError::InvalidSampler(format!(
                            "rank {rank} of {world}: its fixed shard was not loaded by this \
                             process (it holds {} of {} samples for other ranks)",
                            held.len(),
                            self.full_len
                        ))
                    })?;
                ShardedSampler::fixed(local, rank, seed)
            }
        }
    }
}

/// Loads `dataset` holding only the fixed shards of ranks `ranks` of `world` (the test set
/// whole). A character corpus is held whole: its batches are random windows, not samples.
pub fn load_fixed_shards(
    dataset: &str,
    dir: Option<&Path>,
    ranks: Range<usize>,
    world: usize,
    seed: u64,
) -> Result<(TaskData, Sampling), String> {
    // The ascending indices of the ranks' samples in a training set of `full_len`.
    let union = |full_len: usize| -> Result<Vec<usize>, DataError> {
        let mut held = Vec::new();
        for rank in ranks.clone() {
            held.extend(fixed_shard(full_len, rank, world, seed)?);
        }
        held.sort_unstable();
        Ok(held)
    };
    let holding = |held: Vec<usize>, full_len: usize| Sampling {
        partition: DataPartition::Fixed,
        held: Some(held.into()),
        full_len,
    };
    if let (true, Some(dir)) = (dataset == "mnist", dir) {
        // Only the kept images are read into memory; the selection is made once, from the
        // size in the file's header, and kept for the sampler.
        let selected = std::cell::RefCell::new((Vec::new(), 0));
        let tt = engine::data::mnist::load_mnist_train_subset(
            &crate::task::mnist_folder(dir),
            &|count| {
                let held = union(count)?;
                *selected.borrow_mut() = (held.clone(), count);
                Ok(held)
            },
        )
        .map_err(|e| e.to_string())?;
        let (held, full_len) = selected.into_inner();
        return Ok((TaskData::Images(Arc::new(tt)), holding(held, full_len)));
    }
    match load_data(dataset, dir)? {
        TaskData::Images(tt) => {
            let full_len = tt.train.len();
            let held = union(full_len).map_err(|e| format!("{dataset}: {e}"))?;
            let subset = TrainTest {
                train: tt.train.subset(&held),
                test: tt.test.clone(),
            };
            Ok((TaskData::Images(Arc::new(subset)), holding(held, full_len)))
        }
        chars @ TaskData::Chars(_) => Ok((chars, Sampling::whole(DataPartition::Fixed))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::{ModelKind, Task};

    fn digits_whole() -> Task {
        Task::new(ModelKind::Mlp, "digits", load_data("digits", None).unwrap()).unwrap()
    }

    #[test]
    fn a_process_holding_its_shards_draws_what_the_whole_set_would_give_it() {
        let (world, seed) = (5, 3);
        let mut whole = digits_whole();
        whole.sampling = Sampling::whole(DataPartition::Fixed);
        let (data, sampling) = load_fixed_shards("digits", None, 1..3, world, seed).unwrap();
        let mut held = Task::new(ModelKind::Mlp, "digits", data).unwrap();
        held.sampling = sampling;
        assert_eq!(held.train_len(), 2 * (whole.train_len() / world));
        let (TaskData::Images(w), TaskData::Images(h)) = (&whole.data, &held.data) else {
            panic!("digits are images")
        };
        assert_eq!(h.test, w.test, "the test set is held whole");
        for rank in 1..3 {
            let mut from_whole = whole.sampler(rank, world, seed).unwrap();
            let mut from_held = held.sampler(rank, world, seed).unwrap();
            // Three epochs of the rank's samples: the same images and labels in the same order.
            for _ in 0..3 * from_whole.samples_per_epoch() / 16 {
                let (a, b) = (from_whole.next_batch(16), from_held.next_batch(16));
                let (mut xa, mut ya, mut xb, mut yb) = Default::default();
                w.train.batch_flat(&a, &mut xa, &mut ya);
                h.train.batch_flat(&b, &mut xb, &mut yb);
                assert_eq!((xa.data, ya), (xb.data, yb));
            }
        }
        let other = held.sampler(0, world, seed).unwrap_err().to_string();
        assert!(other.contains("not loaded by this process"), "{other}");
        held.sampling.partition = DataPartition::Reshuffled;
        assert!(held.sampler(1, world, seed).is_err());
    }
}
