//! The 8x8 digits CSV (scikit-learn layout), embedded in the binary as the default data set.
//!
//! Format: one header row of 65 names (`pixel_0_0` … `pixel_7_7`, then `label`), then one row per
//! image: 64 integers `0..=16` and a label `0..=9`. The shipped file (`engine/data/digits.csv`)
//! holds 1797 images and is compiled into the binary, so training works without any data folder.
//!
//! **Split.** Deterministic and stratified, like scikit-learn's
//! `train_test_split(test_size=0.2, stratify=y)`: the test set has `ceil(0.2 · n)` samples
//! (360 of 1797), shared among classes in proportion to their size (largest remainder, ties to the
//! lower class); within each class the test samples are picked by a Fisher–Yates shuffle driven by
//! `ChaCha8Rng::seed_from_u64(`[`SPLIT_SEED`]`)` (one generator, classes in order 0..9). Both splits
//! keep the file's row order. The embedded file splits 1437 train / 360 test.
//!
//! **Normalization.** Pixels are scaled to `[0, 1]` (÷16), then standardized with one mean and one
//! standard deviation computed over all pixels of the *training* split (so the test split leaks
//! nothing), the same way MNIST is normalized with global statistics. Samples have shape `[1, 8, 8]`.

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::sampler::shuffle_in_place;
use super::{DataError, Dataset, TrainTest};

/// Seed of the generator that picks the test samples of each class.
pub const SPLIT_SEED: u64 = 42;
/// Percentage of samples held out for the test split (rounded up, as scikit-learn does).
pub const TEST_PERCENT: usize = 20;
/// Number of classes (digits 0..9).
pub const CLASSES: usize = 10;
/// Side of the square images.
pub const IMAGE_SIDE: usize = 8;
/// Largest pixel value in the CSV.
pub const MAX_PIXEL: u32 = 16;

const PIXELS: usize = IMAGE_SIDE * IMAGE_SIDE;
const EMBEDDED_CSV: &str = include_str!("../../data/digits.csv");
const EMBEDDED_NAME: &str = "<embedded digits.csv>";

/// The digits data set compiled into the binary, split and normalized as described above.
///
/// # Panics
/// Never in practice: the embedded file is checked by this module's tests.
pub fn load_digits_embedded() -> TrainTest {
    parse_digits_csv(EMBEDDED_CSV, Path::new(EMBEDDED_NAME))
        .expect("the embedded digits.csv is valid")
}

/// Reads a digits CSV from `path` (same layout as the embedded one) and splits it.
pub fn load_digits_csv(path: &Path) -> Result<TrainTest, DataError> {
    if !path.is_file() {
        return Err(DataError::MissingFile {
            path: path.to_path_buf(),
            hint: "pass the path of a CSV with 64 pixel_r_c columns and a label column \
                   (or omit it to use the embedded digits)"
                .to_string(),
        });
    }
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_digits_csv(&text, path)
}

/// Parses digits CSV `text` (`source` names it in errors), then splits and normalizes it.
pub fn parse_digits_csv(text: &str, source: &Path) -> Result<TrainTest, DataError> {
    let (pixels, labels) = parse_rows(text, source)?;
    let (train_rows, test_rows) = stratified_split(&labels);
    let (mean, std) = pixel_statistics(&pixels, &train_rows);
    let build = |rows: &[usize], name: &str| {
        let mut features = Vec::with_capacity(rows.len() * PIXELS);
        for &row in rows {
            features.extend(pixels[row * PIXELS..(row + 1) * PIXELS].iter().map(|&raw| {
                let scaled = f64::from(raw) / f64::from(MAX_PIXEL);
                ((scaled - mean) / std) as f32
            }));
        }
        Dataset {
            name: name.to_string(),
            sample_shape: vec![1, IMAGE_SIDE, IMAGE_SIDE],
            features: features.into(),
            labels: rows.iter().map(|&row| labels[row]).collect(),
            classes: CLASSES,
        }
    };
    Ok(TrainTest {
        train: build(&train_rows, "digits-train"),
        test: build(&test_rows, "digits-test"),
    })
}

/// Raw pixels (`rows × 64`, values 0..=16) and labels of every data row.
fn parse_rows(text: &str, source: &Path) -> Result<(Vec<u8>, Vec<u32>), DataError> {
    let error = |line: usize, detail: String| DataError::Csv {
        path: PathBuf::from(source),
        line,
        detail,
    };
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(index, line)| (index + 1, line));
    let (_, header) = lines
        .next()
        .ok_or_else(|| error(1, "empty file: no header row".to_string()))?;
    let columns: Vec<&str> = header.split(',').map(str::trim).collect();
    if columns.len() != PIXELS + 1 || columns[PIXELS] != "label" {
        return Err(error(
            1,
            format!(
                "header must have {PIXELS} pixel columns then `label`, found {} columns",
                columns.len()
            ),
        ));
    }

    let mut pixels = Vec::new();
    let mut labels = Vec::new();
    for (line_number, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let mut cells = 0;
        for (column, cell) in line.split(',').enumerate() {
            cells += 1;
            if column > PIXELS {
                continue;
            }
            let value: u32 = cell.trim().parse().map_err(|_| {
                error(
                    line_number,
                    format!(
                        "column {} (`{}`): `{cell}` is not an integer",
                        column + 1,
                        columns[column]
                    ),
                )
            })?;
            if column < PIXELS {
                if value > MAX_PIXEL {
                    return Err(error(
                        line_number,
                        format!(
                            "column {} (`{}`): pixel {value} > {MAX_PIXEL}",
                            column + 1,
                            columns[column]
                        ),
                    ));
                }
                pixels.push(value as u8);
            } else {
                if value as usize >= CLASSES {
                    return Err(error(
                        line_number,
                        format!("label {value} is not a digit 0..=9"),
                    ));
                }
                labels.push(value);
            }
        }
        if cells != PIXELS + 1 {
            return Err(error(
                line_number,
                format!("expected {} columns, found {cells}", PIXELS + 1),
            ));
        }
    }
    if labels.is_empty() {
        return Err(error(1, "no data rows after the header".to_string()));
    }
    Ok((pixels, labels))
}

/// Row indices of the training and test splits, each in file order (see the module docs).
fn stratified_split(labels: &[u32]) -> (Vec<usize>, Vec<usize>) {
    let total = labels.len();
    let test_total = (total * TEST_PERCENT).div_ceil(100);
    let mut rows_by_class: Vec<Vec<usize>> = vec![Vec::new(); CLASSES];
    for (row, &label) in labels.iter().enumerate() {
        rows_by_class[label as usize].push(row);
    }

    // Largest-remainder apportionment of `test_total` among classes.
    let mut quotas: Vec<usize> = rows_by_class
        .iter()
        .map(|rows| rows.len() * test_total / total)
        .collect();
    let mut by_remainder: Vec<usize> = (0..CLASSES).collect();
    by_remainder
        .sort_by_key(|&class| std::cmp::Reverse(rows_by_class[class].len() * test_total % total));
    let leftover = test_total - quotas.iter().sum::<usize>();
    for &class in by_remainder.iter().take(leftover) {
        quotas[class] += 1;
    }

    let mut rng = ChaCha8Rng::seed_from_u64(SPLIT_SEED);
    let mut is_test = vec![false; total];
    for (rows, &quota) in rows_by_class.iter_mut().zip(&quotas) {
        shuffle_in_place(&mut rng, rows);
        for &row in &rows[..quota] {
            is_test[row] = true;
        }
    }
    (0..total).partition(|&row| !is_test[row])
}

/// Mean and standard deviation of the ÷16-scaled pixels of `rows` (std floored at 1e-6).
fn pixel_statistics(pixels: &[u8], rows: &[usize]) -> (f64, f64) {
    let (mut sum, mut sum_squares, mut count) = (0.0f64, 0.0f64, 0usize);
    for &row in rows {
        for &raw in &pixels[row * PIXELS..(row + 1) * PIXELS] {
            let scaled = f64::from(raw) / f64::from(MAX_PIXEL);
            sum += scaled;
            sum_squares += scaled * scaled;
            count += 1;
        }
    }
    let mean = sum / count.max(1) as f64;
    let variance = (sum_squares / count.max(1) as f64 - mean * mean).max(0.0);
    (mean, variance.sqrt().max(1e-6))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::locate::shared_datasets_dir;

    fn header() -> String {
        let mut names: Vec<String> = (0..PIXELS)
            .map(|i| format!("pixel_{}_{}", i / 8, i % 8))
            .collect();
        names.push("label".into());
        names.join(",")
    }

    fn row(pixel: u32, label: u32) -> String {
        let mut cells = vec![pixel.to_string(); PIXELS];
        cells.push(label.to_string());
        cells.join(",")
    }

    #[test]
    fn embedded_digits_split_1437_360_stratified_and_standardized() {
        let data = load_digits_embedded();
        assert_eq!(data.train.len(), 1437);
        assert_eq!(data.test.len(), 360);
        assert_eq!(data.train.sample_shape, vec![1, 8, 8]);
        assert_eq!(data.train.features.len(), 1437 * 64);
        assert_eq!(data.test.features.len(), 360 * 64);
        // Class counts of the file: 178 182 177 183 181 182 181 179 174 180.
        assert_eq!(
            data.test.class_counts(),
            vec![36, 37, 35, 37, 36, 36, 36, 36, 35, 36]
        );
        let all: Vec<usize> = data
            .train
            .class_counts()
            .iter()
            .zip(data.test.class_counts())
            .map(|(a, b)| a + b)
            .collect();
        assert_eq!(all, vec![178, 182, 177, 183, 181, 182, 181, 179, 174, 180]);
        // Training features are standardized.
        let n = data.train.features.len() as f64;
        let mean = data
            .train
            .features
            .to_vec()
            .iter()
            .map(|&x| f64::from(x))
            .sum::<f64>()
            / n;
        let var = data
            .train
            .features
            .to_vec()
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(
            mean.abs() < 1e-4 && (var - 1.0).abs() < 1e-3,
            "mean {mean} var {var}"
        );
        // Deterministic.
        assert_eq!(load_digits_embedded(), data);
    }

    #[test]
    fn shared_copy_matches_embedded_when_present() {
        let Some(path) = shared_datasets_dir()
            .map(|dir| dir.join("digits.csv"))
            .filter(|p| p.is_file())
        else {
            eprintln!("skipping: shared digits.csv not found");
            return;
        };
        assert_eq!(load_digits_csv(&path).unwrap(), load_digits_embedded());
    }

    #[test]
    fn split_keeps_file_order_and_is_disjoint() {
        let labels: Vec<u32> = (0..50).map(|i| (i % 10) as u32).collect();
        let (train, test) = stratified_split(&labels);
        assert_eq!(test.len(), 10);
        assert_eq!(train.len(), 40);
        assert!(train.windows(2).all(|w| w[0] < w[1]) && test.windows(2).all(|w| w[0] < w[1]));
        let mut test_labels: Vec<u32> = test.iter().map(|&row| labels[row]).collect();
        test_labels.sort_unstable();
        assert_eq!(
            test_labels,
            (0..10).collect::<Vec<u32>>(),
            "one test sample per class"
        );
    }

    #[test]
    fn bad_rows_report_line_numbers() {
        let good = row(3, 1);
        let cases = [
            (
                format!("{}\n{good}\n{}\n", header(), row(17, 1)),
                3,
                "pixel 17",
            ),
            (
                format!("{}\n{good}\n{}\n", header(), row(1, 10)),
                3,
                "label 10",
            ),
            (
                format!("{}\n{good},5\n", header()),
                2,
                "expected 65 columns, found 66",
            ),
            (
                format!("{}\n1,2,3\n", header()),
                2,
                "expected 65 columns, found 3",
            ),
            (
                format!("{}\n{}x,0\n", header(), "1,".repeat(63)),
                2,
                "`x` is not an integer",
            ),
            ("a,b\n".to_string(), 1, "header"),
            (format!("{}\n\n", header()), 1, "no data rows"),
        ];
        for (text, line, needle) in cases {
            let error = parse_digits_csv(&text, Path::new("bad.csv")).unwrap_err();
            let message = error.to_string();
            assert!(
                matches!(error, DataError::Csv { line: l, .. } if l == line),
                "{message}"
            );
            assert!(
                message.contains(needle) && message.starts_with("bad.csv:"),
                "{message}"
            );
        }
    }

    #[test]
    fn crlf_and_trailing_blank_lines_are_accepted() {
        let text = format!("{}\r\n{}\r\n{}\r\n\r\n", header(), row(0, 0), row(16, 1));
        let data = parse_digits_csv(&text, Path::new("ok.csv")).unwrap();
        assert_eq!(data.train.len() + data.test.len(), 2);
        assert_eq!(data.test.len(), 1);
    }

    #[test]
    fn missing_csv_is_a_typed_error() {
        let error = load_digits_csv(Path::new("/nonexistent/digits.csv")).unwrap_err();
        assert!(matches!(error, DataError::MissingFile { .. }), "{error}");
    }
}
