//! MNIST IDX (.gz or raw) loader.
//!
//! Reads the four standard files (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
//! `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`), each either gzip-compressed (`.gz`, read
//! through `flate2`, preferred when present) or raw. Headers are validated (magic 2051 for images,
//! 2049 for labels, matching counts), truncation is reported, and pixels are normalized with the
//! usual MNIST statistics: `(x / 255 − 0.1307) / 0.3081`. Samples have shape `[1, 28, 28]`
//! (or whatever the header says), labels are `0..10`.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;

use super::{DataError, Dataset, Features, TrainTest};

/// Magic number of an IDX file of unsigned bytes with 3 dimensions (images).
pub const IMAGES_MAGIC: u32 = 2051;
/// Magic number of an IDX file of unsigned bytes with 1 dimension (labels).
pub const LABELS_MAGIC: u32 = 2049;
/// Mean of MNIST training pixels scaled to `[0, 1]`.
pub const PIXEL_MEAN: f32 = 0.1307;
/// Standard deviation of MNIST training pixels scaled to `[0, 1]`.
pub const PIXEL_STD: f32 = 0.3081;
/// Number of MNIST classes.
pub const CLASSES: usize = 10;

const MISSING_HINT: &str =
    "pass --data-dir pointing at a folder with train-images-idx3-ubyte(.gz), \
     train-labels-idx1-ubyte(.gz), t10k-images-idx3-ubyte(.gz) and t10k-labels-idx1-ubyte(.gz)";

/// Loads the full MNIST training (60 000) and test (10 000) sets from `dir`.
pub fn load_mnist(dir: &Path) -> Result<TrainTest, DataError> {
    load_mnist_limited(dir, usize::MAX, usize::MAX)
}

/// Loads at most the first `max_train` training and `max_test` test samples from `dir`; only the
/// needed prefix of each file is decompressed, so small limits are fast. Header counts are still
/// validated in full (images vs labels).
pub fn load_mnist_limited(
    dir: &Path,
    max_train: usize,
    max_test: usize,
) -> Result<TrainTest, DataError> {
    let train = load_split(dir, "train", "mnist-train", max_train, None)?;
    let test = load_split(dir, "t10k", "mnist-test", max_test, None)?;
    Ok(TrainTest { train, test })
}

/// Which training samples to keep, given the training set's size from the file's header:
/// indices in ascending order, each below the size.
pub type SampleSelection<'a> = &'a dyn Fn(usize) -> Result<Vec<usize>, DataError>;

/// The whole test set and only the training samples `select` picks, in ascending index
/// order. The images are read one after another and the others are skipped, so memory never
/// holds more than the kept samples (a node that trains fixed shards).
pub fn load_mnist_train_subset(
    dir: &Path,
    select: SampleSelection,
) -> Result<TrainTest, DataError> {
    let train = load_split(dir, "train", "mnist-train", usize::MAX, Some(select))?;
    let test = load_split(dir, "t10k", "mnist-test", usize::MAX, None)?;
    Ok(TrainTest { train, test })
}

fn load_split(
    dir: &Path,
    prefix: &str,
    name: &str,
    max_samples: usize,
    select: Option<SampleSelection>,
) -> Result<Dataset, DataError> {
    let images_path = locate(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let labels_path = locate(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    let mut images = open(&images_path)?;
    let mut labels = open(&labels_path)?;

    let image_header = read_header::<4>(&mut images, &images_path, IMAGES_MAGIC)?;
    let label_header = read_header::<2>(&mut labels, &labels_path, LABELS_MAGIC)?;
    let [_, image_count, rows, cols] = image_header;
    let [_, label_count] = label_header;
    if image_count != label_count {
        return Err(DataError::CountMismatch {
            images: images_path,
            image_count: image_count.into(),
            labels: labels_path,
            label_count: label_count.into(),
        });
    }
    if rows == 0 || cols == 0 {
        return Err(DataError::BadHeader {
            path: images_path,
            detail: format!("image size {rows}x{cols}"),
        });
    }
    let count = (image_count as usize).min(max_samples);
    let pixels_per_image = rows as usize * cols as usize;

    let mut label_bytes = vec![0u8; count];
    read_payload(&mut labels, &labels_path, &mut label_bytes)?;
    if let Some(index) = label_bytes
        .iter()
        .position(|&label| label as usize >= CLASSES)
    {
        return Err(DataError::LabelOutOfRange {
            path: labels_path,
            index,
            label: label_bytes[index].into(),
            classes: CLASSES,
        });
    }

    let (label_bytes, pixel_bytes) = match select {
        None => {
            let mut pixel_bytes = vec![0u8; count * pixels_per_image];
            read_payload(&mut images, &images_path, &mut pixel_bytes)?;
            (label_bytes, pixel_bytes)
        }
        Some(select) => {
            let keep = select(count)?;
            if keep.windows(2).any(|w| w[0] >= w[1]) || keep.last().is_some_and(|&i| i >= count) {
                return Err(DataError::InvalidSampler(format!(
                    "{}: a selection of training samples must be ascending and below {count}",
                    images_path.display()
                )));
            }
            let pixel_bytes =
                read_selected_rows(&mut images, &images_path, count, pixels_per_image, &keep)?;
            (keep.iter().map(|&i| label_bytes[i]).collect(), pixel_bytes)
        }
    };
    // Kept as the bytes they are (a quarter of the memory); decoded per batch.
    let features = Features::from_bytes(pixel_bytes, |byte| {
        (byte as f32 / 255.0 - PIXEL_MEAN) / PIXEL_STD
    });

    Ok(Dataset {
        name: name.to_string(),
        sample_shape: vec![1, rows as usize, cols as usize],
        features,
        labels: label_bytes.into_iter().map(u32::from).collect(),
        classes: CLASSES,
    })
}

/// `dir/name.gz` when it exists, else `dir/name`, else a [`DataError::MissingFile`].
fn locate(dir: &Path, name: &str) -> Result<PathBuf, DataError> {
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    let raw = dir.join(name);
    if raw.is_file() {
        return Ok(raw);
    }
    Err(DataError::MissingFile {
        path: raw,
        hint: MISSING_HINT.to_string(),
    })
}

fn open(path: &Path) -> Result<Box<dyn Read>, DataError> {
    let file = File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let reader = BufReader::with_capacity(1 << 16, file);
    if path.extension().is_some_and(|ext| ext == "gz") {
        Ok(Box::new(MultiGzDecoder::new(reader)))
    } else {
        Ok(Box::new(reader))
    }
}

/// Reads `N` big-endian u32 header words; the first must be `magic` (checked before the rest is
/// read, so a wrong kind of file reports its magic rather than a truncation).
fn read_header<const N: usize>(
    reader: &mut dyn Read,
    path: &Path,
    magic: u32,
) -> Result<[u32; N], DataError> {
    let mut words = [0u32; N];
    let mut filled = 0u64;
    for (position, word) in words.iter_mut().enumerate() {
        let mut bytes = [0u8; 4];
        let got = read_fully(reader, path, &mut bytes)?;
        filled += got as u64;
        if got < 4 {
            return Err(DataError::Truncated {
                path: path.to_path_buf(),
                expected: 4 * N as u64,
                found: filled,
            });
        }
        *word = u32::from_be_bytes(bytes);
        if position == 0 && *word != magic {
            return Err(DataError::BadMagic {
                path: path.to_path_buf(),
                expected: magic,
                found: *word,
            });
        }
    }
    Ok(words)
}

/// Reads `count` rows of `width` bytes and keeps those at `keep` (ascending), skipping the
/// others through one row of scratch.
fn read_selected_rows(
    reader: &mut dyn Read,
    path: &Path,
    count: usize,
    width: usize,
    keep: &[usize],
) -> Result<Vec<u8>, DataError> {
    let mut kept = Vec::with_capacity(keep.len() * width);
    let mut row = vec![0u8; width];
    let mut wanted = keep.iter().peekable();
    for index in 0..count {
        if wanted.peek().is_none() {
            break;
        }
        let got = read_fully(reader, path, &mut row)?;
        if got < width {
            return Err(DataError::Truncated {
                path: path.to_path_buf(),
                expected: (count * width) as u64,
                found: (index * width + got) as u64,
            });
        }
        if wanted.next_if_eq(&&index).is_some() {
            kept.extend_from_slice(&row);
        }
    }
    Ok(kept)
}

fn read_payload(reader: &mut dyn Read, path: &Path, buffer: &mut [u8]) -> Result<(), DataError> {
    let got = read_fully(reader, path, buffer)?;
    if got < buffer.len() {
        return Err(DataError::Truncated {
            path: path.to_path_buf(),
            expected: buffer.len() as u64,
            found: got as u64,
        });
    }
    Ok(())
}

/// Reads until `buffer` is full or the stream ends; returns the number of bytes read.
fn read_fully(reader: &mut dyn Read, path: &Path, buffer: &mut [u8]) -> Result<usize, DataError> {
    let mut filled = 0;
    while filled < buffer.len() {
        match reader.read(&mut buffer[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(DataError::Io {
                    path: path.to_path_buf(),
                    source,
                })
            }
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::data::locate::shared_datasets_dir;
    use crate::tensor::Tensor;

    /// A fresh, empty temporary folder unique to `tag` and this process.
    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dreamddp-mnist-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn idx_images(count: u32, rows: u32, cols: u32, pixels: &[u8]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for word in [IMAGES_MAGIC, count, rows, cols] {
            bytes.extend_from_slice(&word.to_be_bytes());
        }
        bytes.extend_from_slice(pixels);
        bytes
    }

    fn idx_labels(labels: &[u8]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for word in [LABELS_MAGIC, labels.len() as u32] {
            bytes.extend_from_slice(&word.to_be_bytes());
        }
        bytes.extend_from_slice(labels);
        bytes
    }

    fn write_gz(path: &Path, bytes: &[u8]) {
        let mut encoder =
            flate2::write::GzEncoder::new(File::create(path).unwrap(), flate2::Compression::fast());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap();
    }

    /// Writes a tiny 2x2 MNIST-like set: 3 train and 2 test samples; train as gzip, test raw.
    fn write_tiny_set(dir: &Path) {
        write_gz(
            &dir.join("train-images-idx3-ubyte.gz"),
            &idx_images(3, 2, 2, &[0, 255, 0, 255, 1, 2, 3, 4, 9, 9, 9, 9]),
        );
        write_gz(
            &dir.join("train-labels-idx1-ubyte.gz"),
            &idx_labels(&[7, 0, 9]),
        );
        std::fs::write(
            dir.join("t10k-images-idx3-ubyte"),
            idx_images(2, 2, 2, &[255; 8]),
        )
        .unwrap();
        std::fs::write(dir.join("t10k-labels-idx1-ubyte"), idx_labels(&[1, 2])).unwrap();
    }

    #[test]
    fn reads_gzip_and_raw_files_and_normalizes() {
        let dir = temp_dir("ok");
        write_tiny_set(&dir);
        let data = load_mnist(&dir).unwrap();
        assert_eq!(data.train.len(), 3);
        assert_eq!(data.train.sample_shape, vec![1, 2, 2]);
        assert_eq!(data.train.labels, vec![7, 0, 9]);
        assert_eq!(data.test.labels, vec![1, 2]);
        let black = -PIXEL_MEAN / PIXEL_STD;
        let white = (1.0 - PIXEL_MEAN) / PIXEL_STD;
        let train = data.train.features.to_vec();
        assert!((train[0] - black).abs() < 1e-6);
        assert!((train[1] - white).abs() < 1e-6);
        assert!(data
            .test
            .features
            .to_vec()
            .iter()
            .all(|&x| (x - white).abs() < 1e-6));
        assert!(
            matches!(data.train.features, Features::Bytes { .. }),
            "MNIST is held as bytes"
        );

        let subset = load_mnist_train_subset(&dir, &|count| {
            assert_eq!(count, 3);
            Ok(vec![0, 2])
        })
        .unwrap();
        assert_eq!(subset.train, data.train.subset(&[0, 2]));
        assert_eq!(subset.test, data.test);
        let unsorted = load_mnist_train_subset(&dir, &|_| Ok(vec![2, 0])).unwrap_err();
        assert!(unsorted.to_string().contains("ascending"), "{unsorted}");
        let beyond = load_mnist_train_subset(&dir, &|_| Ok(vec![3])).unwrap_err();
        assert!(beyond.to_string().contains("below 3"), "{beyond}");

        let limited = load_mnist_limited(&dir, 2, 1).unwrap();
        assert_eq!(limited.train.labels, vec![7, 0]);
        assert_eq!(limited.train.features.len(), 8);
        assert_eq!(limited.test.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_file_error_names_file_and_fix() {
        let dir = temp_dir("missing");
        let message = load_mnist(&dir).unwrap_err().to_string();
        assert!(message.contains("train-images-idx3-ubyte"), "{message}");
        assert!(message.contains("--data-dir"), "{message}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_magic_truncation_count_mismatch_and_bad_label_are_typed_errors() {
        let dir = temp_dir("bad");
        write_tiny_set(&dir);
        // Labels passed where images belong: bad magic.
        std::fs::write(dir.join("t10k-images-idx3-ubyte"), idx_labels(&[1, 2])).unwrap();
        let error = load_mnist(&dir).unwrap_err();
        assert!(
            matches!(
                error,
                DataError::BadMagic {
                    expected: IMAGES_MAGIC,
                    found: LABELS_MAGIC,
                    ..
                }
            ),
            "{error}"
        );

        // Header announces 2 images but only 5 pixel bytes follow.
        std::fs::write(
            dir.join("t10k-images-idx3-ubyte"),
            idx_images(2, 2, 2, &[0; 5]),
        )
        .unwrap();
        let error = load_mnist(&dir).unwrap_err();
        assert!(
            matches!(
                error,
                DataError::Truncated {
                    expected: 8,
                    found: 5,
                    ..
                }
            ),
            "{error}"
        );
        // ... but a limit that only needs the complete first image succeeds.
        assert_eq!(load_mnist_limited(&dir, 3, 1).unwrap().test.len(), 1);

        // Truncated header.
        std::fs::write(
            dir.join("t10k-images-idx3-ubyte"),
            &idx_images(2, 2, 2, &[])[..6],
        )
        .unwrap();
        let error = load_mnist(&dir).unwrap_err();
        assert!(
            matches!(
                error,
                DataError::Truncated {
                    expected: 16,
                    found: 6,
                    ..
                }
            ),
            "{error}"
        );

        // 2 images, 3 labels.
        std::fs::write(
            dir.join("t10k-images-idx3-ubyte"),
            idx_images(2, 2, 2, &[0; 8]),
        )
        .unwrap();
        std::fs::write(dir.join("t10k-labels-idx1-ubyte"), idx_labels(&[1, 2, 3])).unwrap();
        let error = load_mnist(&dir).unwrap_err();
        assert!(
            matches!(
                error,
                DataError::CountMismatch {
                    image_count: 2,
                    label_count: 3,
                    ..
                }
            ),
            "{error}"
        );

        // Label 12 is not a digit.
        std::fs::write(dir.join("t10k-labels-idx1-ubyte"), idx_labels(&[1, 12])).unwrap();
        let error = load_mnist(&dir).unwrap_err();
        assert!(
            matches!(
                error,
                DataError::LabelOutOfRange {
                    index: 1,
                    label: 12,
                    ..
                }
            ),
            "{error}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn real_mnist_prefix_has_expected_shapes_when_present() {
        let Some(dir) = shared_datasets_dir().map(|datasets| datasets.join("mnist")) else {
            eprintln!("skipping: shared data sets folder not found");
            return;
        };
        if !dir.is_dir() {
            eprintln!("skipping: {} not found", dir.display());
            return;
        }
        let data = load_mnist_limited(&dir, 1000, 100).unwrap();
        assert_eq!(data.train.len(), 1000);
        assert_eq!(data.test.len(), 100);
        assert_eq!(data.train.sample_shape, vec![1, 28, 28]);
        assert_eq!(data.train.features.len(), 1000 * 784);
        assert_eq!(data.test.features.len(), 100 * 784);
        assert!(data
            .train
            .labels
            .iter()
            .chain(&data.test.labels)
            .all(|&label| label < 10));
        // The first MNIST training labels are 5, 0, 4, 1; the first test labels 7, 2, 1, 0.
        assert_eq!(data.train.labels[..4], [5, 0, 4, 1]);
        assert_eq!(data.test.labels[..4], [7, 2, 1, 0]);
        assert_eq!(
            data.train
                .class_counts()
                .iter()
                .filter(|&&count| count > 0)
                .count(),
            10
        );
        // Roughly standardized: mean near 0 over the first 1000 images.
        let mean =
            data.train.features.to_vec().iter().sum::<f32>() / data.train.features.len() as f32;
        assert!(mean.abs() < 0.1, "mean {mean}");
        let mut batch = Tensor::default();
        let mut targets = Vec::new();
        data.train.batch(&[0, 1], &mut batch, &mut targets);
        assert_eq!(batch.shape, vec![2, 1, 28, 28]);
        assert_eq!(targets, vec![5, 0]);
    }
}
