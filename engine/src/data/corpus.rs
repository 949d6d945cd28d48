//! Character corpus (tinyshakespeare) with a vocabulary and train/validation split.
//!
//! Like nanoGPT's `shakespeare_char`: the vocabulary is the sorted set of distinct characters,
//! each character's token id is its index in that list, and the first `⌊n · (1 − val_fraction)⌋`
//! tokens are the training split, the rest the validation split ([`CharCorpus::load`] uses 10 %).
//! Batches are random windows: row `b` holds `context` consecutive tokens starting at a uniform
//! offset, and its targets are the same window shifted by one token.

use std::path::{Path, PathBuf};

use rand::Rng;

use super::DataError;
use crate::tensor::Tensor;

/// Fraction of tokens held out for validation by [`CharCorpus::load`] (as in nanoGPT).
pub const DEFAULT_VAL_FRACTION: f64 = 0.1;

/// Which split of a corpus to sample from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// The first part of the text.
    Train,
    /// The held-out tail of the text.
    Val,
}

/// A character-level corpus: vocabulary plus tokenized train and validation splits.
#[derive(Clone, Debug, PartialEq)]
pub struct CharCorpus {
    /// Distinct characters in ascending order; token id = index.
    pub vocab: Vec<char>,
    /// Training tokens.
    pub train: Vec<u32>,
    /// Validation tokens.
    pub val: Vec<u32>,
}

impl CharCorpus {
    /// Reads a UTF-8 text file and splits it 90/10.
    pub fn load(path: &Path) -> Result<Self, DataError> {
        if !path.is_file() {
            return Err(DataError::MissingFile {
                path: path.to_path_buf(),
                hint: "pass --data-dir pointing at a folder with tinyshakespeare/input.txt (any UTF-8 text works)"
                    .to_string(),
            });
        }
        let bytes = std::fs::read(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let text = String::from_utf8(bytes).map_err(|error| DataError::Corpus {
            path: path.to_path_buf(),
            detail: format!(
                "not UTF-8 (invalid byte at offset {})",
                error.utf8_error().valid_up_to()
            ),
        })?;
        Self::build(&text, DEFAULT_VAL_FRACTION, path)
    }

    /// Builds a corpus from in-memory `text`, holding out the last `val_fraction` of it.
    /// Both splits must hold at least two tokens (one input and one target).
    pub fn from_text(text: &str, val_fraction: f64) -> Result<Self, DataError> {
        Self::build(text, val_fraction, Path::new("<text>"))
    }

    fn build(text: &str, val_fraction: f64, source: &Path) -> Result<Self, DataError> {
        let error = |detail: String| DataError::Corpus {
            path: PathBuf::from(source),
            detail,
        };
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(error(format!(
                "validation fraction {val_fraction} is not in [0, 1)"
            )));
        }
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        let tokens: Vec<u32> = text
            .chars()
            .map(|ch| {
                vocab
                    .binary_search(&ch)
                    .expect("every character is in the vocabulary") as u32
            })
            .collect();
        let train_len = (tokens.len() as f64 * (1.0 - val_fraction)).floor() as usize;
        let val_len = tokens.len() - train_len;
        if train_len < 2 || val_len < 2 {
            return Err(error(format!(
                "{} characters split into {train_len} train and {val_len} validation tokens; each split needs at least 2",
                tokens.len()
            )));
        }
        let val = tokens[train_len..].to_vec();
        let mut train = tokens;
        train.truncate(train_len);
        Ok(Self { vocab, train, val })
    }

    /// Number of distinct tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The tokens of `split`.
    pub fn tokens(&self, split: Split) -> &[u32] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// Longest context [`CharCorpus::sample_batch`] accepts for `split` (its length − 1).
    pub fn max_context(&self, split: Split) -> usize {
        self.tokens(split).len() - 1
    }

    /// Checks that `context` fits both splits; call it when validating a configuration.
    pub fn check_context(&self, context: usize) -> Result<(), DataError> {
        let longest = self
            .max_context(Split::Train)
            .min(self.max_context(Split::Val));
        if context == 0 || context > longest {
            return Err(DataError::Corpus {
                path: PathBuf::from("<corpus>"),
                detail: format!("context {context} must be in 1..={longest} for this corpus"),
            });
        }
        Ok(())
    }

    /// Token ids of `text`, or an error naming the first character outside the vocabulary.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        text.chars()
            .map(|ch| {
                self.vocab
                    .binary_search(&ch)
                    .map(|id| id as u32)
                    .map_err(|_| DataError::Corpus {
                        path: PathBuf::from("<prompt>"),
                        detail: format!("character {ch:?} is not in the vocabulary"),
                    })
            })
            .collect()
    }

    /// The text of `tokens`; ids outside the vocabulary become `U+FFFD`.
    pub fn decode(&self, tokens: &[u32]) -> String {
        tokens
            .iter()
            .map(|&id| {
                self.vocab
                    .get(id as usize)
                    .copied()
                    .unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect()
    }

    /// A random batch: a `[batch, context]` tensor of token ids (as f32) and the `batch · context`
    /// next-token targets, row-major.
    ///
    /// # Panics
    /// When `context` is 0 or longer than [`CharCorpus::max_context`] (see `check_context`).
    pub fn sample_batch<R: Rng + ?Sized>(
        &self,
        rng: &mut R,
        batch: usize,
        context: usize,
        split: Split,
    ) -> (Tensor, Vec<usize>) {
        let mut inputs = Tensor::default();
        let mut targets = Vec::with_capacity(batch * context);
        self.sample_batch_into(rng, batch, context, split, &mut inputs, &mut targets);
        (inputs, targets)
    }

    /// Like [`CharCorpus::sample_batch`] but refills `inputs` and `targets`, reusing their buffers.
    pub fn sample_batch_into<R: Rng + ?Sized>(
        &self,
        rng: &mut R,
        batch: usize,
        context: usize,
        split: Split,
        inputs: &mut Tensor,
        targets: &mut Vec<usize>,
    ) {
        let tokens = self.tokens(split);
        assert!(
            context >= 1 && context < tokens.len(),
            "context {context} does not fit a split of {} tokens",
            tokens.len()
        );
        inputs.shape.clear();
        inputs.shape.extend_from_slice(&[batch, context]);
        inputs.data.clear();
        targets.clear();
        let starts = tokens.len() - context;
        for _ in 0..batch {
            let start = rng.random_range(0..starts);
            let window = &tokens[start..start + context + 1];
            inputs
                .data
                .extend(window[..context].iter().map(|&id| id as f32));
            targets.extend(window[1..].iter().map(|&id| id as usize));
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::data::locate::shared_tinyshakespeare_path;

    #[test]
    fn vocabulary_split_and_round_trip() {
        let text = "hello world, hello rust!";
        let corpus = CharCorpus::from_text(text, 0.25).unwrap();
        assert_eq!(
            corpus.vocab,
            vec![' ', '!', ',', 'd', 'e', 'h', 'l', 'o', 'r', 's', 't', 'u', 'w']
        );
        assert_eq!(corpus.train.len(), 18);
        assert_eq!(corpus.val.len(), 6);
        let mut all = corpus.train.clone();
        all.extend(&corpus.val);
        assert_eq!(corpus.decode(&all), text);
        assert_eq!(corpus.encode("hello").unwrap(), corpus.train[..5]);
        assert!(corpus
            .encode("hello?")
            .unwrap_err()
            .to_string()
            .contains("'?'"));
        assert_eq!(corpus.decode(&[99]), "\u{FFFD}");
    }

    #[test]
    fn batches_are_shifted_windows_of_the_requested_split() {
        let text: String = (0..200)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let corpus = CharCorpus::from_text(&text, 0.1).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (inputs, targets) = corpus.sample_batch(&mut rng, 4, 8, Split::Val);
        assert_eq!(inputs.shape, vec![4, 8]);
        assert_eq!(targets.len(), 32);
        for row in 0..4 {
            let window = &inputs.data[row * 8..(row + 1) * 8];
            // The alphabet is cyclic: each target is the next letter after its input.
            for t in 0..8 {
                assert_eq!(targets[row * 8 + t], (window[t] as usize + 1) % 26);
            }
            // Windows come from the validation split (positions 180..200).
            let ids: Vec<u32> = window.iter().map(|&id| id as u32).collect();
            assert!(corpus.decode(&corpus.val).contains(&corpus.decode(&ids)));
        }
        assert!(corpus.check_context(19).is_ok());
        assert!(corpus.check_context(20).is_err());
        assert!(corpus.check_context(0).is_err());
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn oversized_context_panics_with_a_message() {
        let corpus = CharCorpus::from_text("abcdefghij", 0.3).unwrap();
        corpus.sample_batch(&mut ChaCha8Rng::seed_from_u64(1), 1, 3, Split::Val);
    }

    #[test]
    fn unusable_text_is_a_typed_error() {
        assert!(matches!(
            CharCorpus::from_text("abc", 0.1),
            Err(DataError::Corpus { .. })
        ));
        assert!(matches!(
            CharCorpus::from_text("abcdefgh", 1.0),
            Err(DataError::Corpus { .. })
        ));
        let error = CharCorpus::load(Path::new("/nonexistent/input.txt")).unwrap_err();
        assert!(error.to_string().contains("--data-dir"), "{error}");
    }

    #[test]
    fn tinyshakespeare_matches_nanogpt_when_present() {
        let Some(path) = shared_tinyshakespeare_path() else {
            eprintln!("skipping: tinyshakespeare/input.txt not found");
            return;
        };
        let corpus = CharCorpus::load(&path).unwrap();
        // nanoGPT's prepare.py reports 65 characters, 1,003,854 train and 111,540 val tokens.
        assert_eq!(corpus.vocab_size(), 65);
        assert_eq!(corpus.train.len(), 1_003_854);
        assert_eq!(corpus.val.len(), 111_540);
        assert!(corpus
            .decode(&corpus.train[..14])
            .starts_with("First Citizen"));
    }
}
