//! Sharded sampler: each worker sees its own shard, reshuffled per epoch (like DistributedSampler).
//!
//! Every epoch `e`, all ranks compute the same permutation of `0..n` with a Fisher–Yates shuffle
//! driven by `ChaCha8Rng::seed_from_u64(seed)` on stream `e` (`set_stream(e)`), so no
//! communication is needed to agree on it. Rank `r` of `world` takes positions
//! `r, r + world, r + 2·world, …` of that permutation, exactly like PyTorch's
//! `DistributedSampler`:
//!
//! * `drop_last = true`: each rank gets `⌊n / world⌋` samples; the permutation's tail is dropped, so
//!   shards are disjoint.
//! * `drop_last = false`: each rank gets `⌈n / world⌉` samples; the permutation is padded by
//!   wrapping around to its start, so shards cover the whole data set and only the padding repeats.
//!
//! The sampler is an endless stream: a batch that runs past the end of this rank's shard continues
//! with the next epoch's shard. Every rank has the same number of samples per epoch, so ranks stay
//! in lock-step as long as they draw the same batch sizes.
//!
//! [`DataPartition::Fixed`] is the federated setting: a device owns its data. Rank `r` keeps
//! the samples of its epoch-0 shard for the whole run ([`fixed_shard`]) and only their order
//! changes from epoch to epoch (a permutation seeded by the seed and the rank); epoch 0 is
//! drawn in the same order in both modes. A process that trains fixed shards needs only those
//! samples in memory ([`ShardedSampler::fixed`] takes indices into what it holds).
//!
//! The shuffle is written out here (index `j = next_u64() mod (i + 1)`) rather than taken from
//! `rand`'s `SliceRandom`, so the order depends only on ChaCha8 and this file.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::DataError;

/// Shuffles `items` in place (Fisher–Yates, `j = next_u64() mod (i + 1)`; the modulo bias is
/// below 2⁻⁴⁰ for any realistic length).
pub fn shuffle_in_place<T, R: RngCore + ?Sized>(rng: &mut R, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// How the training set is divided among the ranks from one epoch to the next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DataPartition {
    /// Every epoch a new permutation of the whole set is dealt out (PyTorch's
    /// `DistributedSampler`): each rank sees every sample over the epochs, so each process
    /// holds the whole set.
    #[default]
    Reshuffled,
    /// Each rank keeps its epoch-0 shard for the whole run (a device owns its data), in a new
    /// order every epoch: a process holds only its ranks' samples.
    Fixed,
}

/// Rank `rank`'s fixed shard of a data set of `dataset_len` samples: its epoch-0 shard of the
/// reshuffled partition (`drop_last`, so shards are disjoint and equal), in drawing order.
pub fn fixed_shard(
    dataset_len: usize,
    rank: usize,
    world: usize,
    seed: u64,
) -> Result<Vec<usize>, DataError> {
    let mut sampler = ShardedSampler::new(dataset_len, rank, world, seed, true)?;
    Ok(std::mem::take(&mut sampler.shard))
}

/// Yields this rank's shard of a data set, batch after batch, epoch after epoch.
#[derive(Clone, Debug)]
pub struct ShardedSampler {
    /// [`DataPartition::Fixed`]: the rank's own samples (indices into the data held), in
    /// epoch-0 order; `None`: reshuffled over `0..dataset_len`.
    fixed: Option<Vec<usize>>,
    dataset_len: usize,
    rank: usize,
    world: usize,
    seed: u64,
    samples_per_epoch: usize,
    epoch: u64,
    position: usize,
    permutation: Vec<usize>,
    shard: Vec<usize>,
}

impl ShardedSampler {
    /// A sampler for rank `rank` of `world` over a data set of `dataset_len` samples, starting at
    /// epoch 0. Fails when `world == 0`, `rank >= world`, or this rank's shard would be empty
    /// (empty data set, or `drop_last` with fewer samples than ranks).
    pub fn new(
        dataset_len: usize,
        rank: usize,
        world: usize,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self, DataError> {
        if world == 0 || rank >= world {
            return Err(DataError::InvalidSampler(format!(
                "rank {rank} is not in a world of {world}"
            )));
        }
        let samples_per_epoch = if drop_last {
            dataset_len / world
        } else {
            dataset_len.div_ceil(world)
        };
        if samples_per_epoch == 0 {
            return Err(DataError::InvalidSampler(format!(
                "{dataset_len} samples give rank {rank} of {world} an empty shard (drop_last = {drop_last})"
            )));
        }
        let mut sampler = Self {
            fixed: None,
            dataset_len,
            rank,
            world,
            seed,
            samples_per_epoch,
            epoch: 0,
            position: 0,
            permutation: Vec::with_capacity(dataset_len),
            shard: Vec::with_capacity(samples_per_epoch),
        };
        sampler.set_epoch(0);
        Ok(sampler)
    }

    /// A [`DataPartition::Fixed`] sampler over `samples` (this rank's own samples as indices
    /// into the data the process holds, in epoch-0 order, e.g. from [`fixed_shard`]): epoch 0
    /// draws them in that order, every later epoch in a fresh permutation seeded by `seed`
    /// and `rank`. Fails when `samples` is empty.
    pub fn fixed(samples: Vec<usize>, rank: usize, seed: u64) -> Result<Self, DataError> {
        if samples.is_empty() {
            return Err(DataError::InvalidSampler(format!(
                "rank {rank} has an empty fixed shard"
            )));
        }
        let mut sampler = Self {
            dataset_len: samples.len(),
            samples_per_epoch: samples.len(),
            fixed: Some(samples),
            rank,
            world: 1,
            seed,
            epoch: 0,
            position: 0,
            permutation: Vec::new(),
            shard: Vec::new(),
        };
        sampler.set_epoch(0);
        Ok(sampler)
    }

    /// The epoch the next drawn index belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Number of indices this rank sees per epoch.
    pub fn samples_per_epoch(&self) -> usize {
        self.samples_per_epoch
    }

    /// Position of the next index inside the current epoch's shard.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Jumps to the start of `epoch` (e.g. when resuming from a checkpoint).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.position = 0;
        if let Some(fixed) = &self.fixed {
            self.shard.clear();
            self.shard.extend_from_slice(fixed);
            if epoch > 0 {
                let mixed = self.seed ^ 0xD1B5_4A32_D192_ED03u64.wrapping_mul(self.rank as u64 + 1);
                let mut rng = ChaCha8Rng::seed_from_u64(mixed);
                rng.set_stream(epoch);
                shuffle_in_place(&mut rng, &mut self.shard);
            }
            return;
        }
        self.permutation.clear();
        self.permutation.extend(0..self.dataset_len);
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(epoch);
        shuffle_in_place(&mut rng, &mut self.permutation);
        self.shard.clear();
        let (permutation, rank, world) = (&self.permutation, self.rank, self.world);
        self.shard.extend(
            (0..self.samples_per_epoch)
                .map(|i| permutation[(rank + i * world) % permutation.len()]),
        );
    }

    /// This rank's indices for the current epoch, in drawing order.
    pub fn current_shard(&self) -> &[usize] {
        &self.shard
    }

    /// The next `batch` indices (see [`ShardedSampler::next_batch_into`]).
    pub fn next_batch(&mut self, batch: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(batch);
        self.next_batch_into(batch, &mut out);
        out
    }

    /// Replaces the contents of `out` with the next `batch` indices, moving on to the next epoch
    /// (a fresh permutation) whenever this rank's shard is used up.
    pub fn next_batch_into(&mut self, batch: usize, out: &mut Vec<usize>) {
        out.clear();
        while out.len() < batch {
            let take = (batch - out.len()).min(self.samples_per_epoch - self.position);
            out.extend_from_slice(&self.shard[self.position..self.position + take]);
            self.position += take;
            if self.position == self.samples_per_epoch {
                self.set_epoch(self.epoch + 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn shards(n: usize, world: usize, seed: u64, drop_last: bool, epoch: u64) -> Vec<Vec<usize>> {
        (0..world)
            .map(|rank| {
                let mut sampler = ShardedSampler::new(n, rank, world, seed, drop_last).unwrap();
                sampler.set_epoch(epoch);
                sampler.current_shard().to_vec()
            })
            .collect()
    }

    #[test]
    fn rejects_unusable_configurations() {
        assert!(ShardedSampler::new(10, 0, 0, 1, false).is_err());
        assert!(ShardedSampler::new(10, 3, 3, 1, false).is_err());
        assert!(ShardedSampler::new(0, 0, 1, 1, false).is_err());
        assert!(ShardedSampler::new(3, 0, 4, 1, true).is_err());
        assert_eq!(
            ShardedSampler::new(3, 3, 4, 1, false)
                .unwrap()
                .samples_per_epoch(),
            1
        );
    }

    #[test]
    fn shuffle_is_a_fixed_function_of_the_seed() {
        let mut items: Vec<u32> = (0..10).collect();
        shuffle_in_place(&mut ChaCha8Rng::seed_from_u64(7), &mut items);
        let mut again: Vec<u32> = (0..10).collect();
        shuffle_in_place(&mut ChaCha8Rng::seed_from_u64(7), &mut again);
        assert_eq!(items, again);
        assert_ne!(items, (0..10).collect::<Vec<u32>>());
        let mut sorted = items.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..10).collect::<Vec<u32>>());
    }

    #[test]
    fn batches_reuse_the_output_buffer_and_cross_epochs() {
        let mut sampler = ShardedSampler::new(5, 0, 1, 3, false).unwrap();
        let epoch0 = sampler.current_shard().to_vec();
        let mut out = Vec::with_capacity(4);
        sampler.next_batch_into(4, &mut out);
        assert_eq!(out, epoch0[..4]);
        sampler.next_batch_into(4, &mut out);
        assert_eq!(sampler.epoch(), 1);
        assert_eq!(out[0], epoch0[4]);
        assert_eq!(out[1..], sampler.current_shard()[..3]);
        assert_eq!(sampler.position(), 3);
    }

    #[test]
    fn a_fixed_shard_keeps_its_samples_and_starts_in_the_reshuffled_order() {
        let (n, world, seed) = (103, 4, 9);
        let mut owners = vec![0usize; n];
        for rank in 0..world {
            let own = fixed_shard(n, rank, world, seed).unwrap();
            let mut reshuffled = ShardedSampler::new(n, rank, world, seed, true).unwrap();
            let mut fixed = ShardedSampler::fixed(own.clone(), rank, seed).unwrap();
            // Epoch 0 is the same stream in both modes.
            assert_eq!(
                fixed.next_batch(own.len()),
                reshuffled.next_batch(own.len())
            );
            // Later epochs: the same samples in another order; the reshuffled rank moves on.
            let mut sorted_own = own.clone();
            sorted_own.sort_unstable();
            for epoch in 1..4 {
                let drawn = fixed.next_batch(own.len());
                assert_eq!(fixed.epoch(), epoch + 1);
                assert_ne!(drawn, own, "epoch {epoch} kept epoch 0's order");
                let mut sorted = drawn.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, sorted_own, "epoch {epoch} drew other samples");
            }
            assert_ne!(reshuffled.next_batch(own.len()), own);
            for index in own {
                owners[index] += 1;
            }
        }
        assert!(
            owners.iter().all(|&count| count <= 1),
            "fixed shards overlap"
        );
        assert!(ShardedSampler::fixed(Vec::new(), 0, seed).is_err());
    }

    proptest! {
        #[test]
        fn shards_partition_the_permutation(n in 1usize..300, world in 1usize..9, seed: u64, epoch in 0u64..5, drop_last: bool) {
            prop_assume!(!drop_last || n >= world);
            let all = shards(n, world, seed, drop_last, epoch);
            let per_rank = if drop_last { n / world } else { n.div_ceil(world) };
            prop_assert!(all.iter().all(|shard| shard.len() == per_rank));
            let mut seen = vec![0usize; n];
            for &index in all.iter().flatten() {
                seen[index] += 1;
            }
            if drop_last {
                prop_assert!(seen.iter().all(|&count| count <= 1), "shards overlap");
                prop_assert_eq!(seen.iter().sum::<usize>(), per_rank * world);
            } else {
                prop_assert!(seen.iter().all(|&count| count >= 1), "a sample is missed");
                // Only the padding (fewer than `world` samples) repeats.
                let duplicates: usize = seen.iter().map(|&count| count - 1).sum();
                prop_assert_eq!(duplicates, per_rank * world - n);
                prop_assert!(duplicates < world);
            }
        }

        #[test]
        fn epochs_differ_and_sampling_is_deterministic(n in 30usize..300, world in 1usize..5, seed: u64, batch in 1usize..40) {
            let epoch0 = shards(n, world, seed, false, 0);
            let epoch1 = shards(n, world, seed, false, 1);
            prop_assert_ne!(&epoch0, &epoch1);
            prop_assert_ne!(&epoch0, &shards(n, world, seed.wrapping_add(1), false, 0));

            let rank = world - 1;
            let mut first = ShardedSampler::new(n, rank, world, seed, false).unwrap();
            let mut second = ShardedSampler::new(n, rank, world, seed, false).unwrap();
            let per_epoch = first.samples_per_epoch();
            let mut stream = Vec::new();
            while stream.len() < 2 * per_epoch {
                let drawn = first.next_batch(batch);
                prop_assert_eq!(&drawn, &second.next_batch(batch));
                stream.extend(drawn);
            }
            // The stream is epoch 0's shard followed by epoch 1's.
            prop_assert_eq!(&stream[..per_epoch], &epoch0[rank][..]);
            prop_assert_eq!(&stream[per_epoch..2 * per_epoch], &epoch1[rank][..]);
            prop_assert_eq!(first.epoch(), (stream.len() / per_epoch) as u64);
        }
    }
}
