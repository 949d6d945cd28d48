//! Splitting a large layer into several sync units (chunks): the one rule every part of
//! dreamddp uses, so a chunk means the same values in a plan ([`crate::plan`]), in the
//! simulator and in a real cluster's wire layout (`node::layout`).
//!
//! A layer of `len` values read as rows of `row_len` values (1: plain values) is cut into the
//! fewest chunks of whole rows that each hold at most `max` values (a row longer than `max`
//! is a chunk by itself), the rows spread evenly over them. Chunk `i` of `n` of layer `fc1` is
//! named `fc1[i/n]`.

/// The lengths, in order, of the chunks of a `len`-value layer of `row_len`-value rows under a
/// cap of `max` values (see the module doc). One chunk (`[len]`) when the layer fits or
/// `max == 0`.
pub fn chunk_lengths(len: usize, row_len: usize, max: usize) -> Vec<usize> {
    if max == 0 || len <= max {
        return vec![len];
    }
    let row_len = row_len.max(1);
    let rows = len.div_ceil(row_len);
    let count = rows.div_ceil((max / row_len).max(1));
    let (base, extra) = (rows / count, rows % count);
    let mut left = len;
    (0..count)
        .map(|i| {
            let chunk = ((base + usize::from(i < extra)) * row_len).min(left);
            left -= chunk;
            chunk
        })
        .collect()
}

/// The f32 values in `kib` KiB: a unit cap given in KiB (`sync_unit_kb`) as a value count.
pub fn values_in_kib(kib: u64) -> usize {
    usize::try_from(kib.saturating_mul(1024) / 4).unwrap_or(usize::MAX)
}

/// A unit cap of `values` f32 values, in KiB (rounded up), for labels.
pub fn kib_of_values(values: usize) -> usize {
    values.saturating_mul(4).div_ceil(1024)
}

/// The name of chunk `i` of `count` of layer `layer` (`layer` itself when `count == 1`).
pub fn chunk_name(layer: &str, i: usize, count: usize) -> String {
    if count == 1 {
        layer.to_string()
    } else {
        format!("{layer}[{i}/{count}]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_layer_that_fits_is_one_chunk_and_rows_are_spread_evenly() {
        assert_eq!(chunk_lengths(100, 1, 100), vec![100]);
        assert_eq!(chunk_lengths(100, 1, 0), vec![100]);
        assert_eq!(chunk_lengths(100, 1, 40), vec![34, 33, 33]);
        // 10 rows of 10: at most 4 rows per chunk -> 3 chunks of 4, 3, 3 rows.
        assert_eq!(chunk_lengths(100, 10, 45), vec![40, 30, 30]);
        // A row longer than the cap is a chunk by itself.
        assert_eq!(chunk_lengths(30, 10, 5), vec![10, 10, 10]);
        assert_eq!(chunk_name("fc1", 0, 1), "fc1");
        assert_eq!(chunk_name("fc1", 2, 4), "fc1[2/4]");
        assert_eq!(values_in_kib(8), 2048);
        assert_eq!(kib_of_values(2048), 8);
        assert_eq!(kib_of_values(2049), 9);
    }

    proptest! {
        #[test]
        fn chunks_cover_the_layer_within_the_cap(
            len in 1usize..5000,
            row_len in 1usize..50,
            max in 1usize..2000,
        ) {
            let chunks = chunk_lengths(len, row_len, max);
            prop_assert_eq!(chunks.iter().sum::<usize>(), len);
            prop_assert!(chunks.iter().all(|&c| c > 0));
            for &c in &chunks {
                prop_assert!(c <= max.max(row_len), "{:?}", chunks);
            }
            if len <= max {
                prop_assert_eq!(chunks.len(), 1);
            }
        }
    }
}
