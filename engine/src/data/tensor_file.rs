//! A generic image/feature classification data set in one `safetensors` file, for models
//! brought from PyTorch: tensors `train_x`, `train_y`, `test_x`, `test_y`.
//!
//! `*_x` is `[N, ...sample shape]` in `F32` (used as is) or `U8` (scaled to [0, 1]); `*_y` is
//! `[N]` class indices in `I64`, `I32`, `U32` or `U8`. Train and test samples must have the
//! same shape; the number of classes is the largest label + 1. Writing one from PyTorch:
//! `safetensors.torch.save_file({"train_x": x, "train_y": y, "test_x": tx, "test_y": ty}, path)`.
//! Every problem is a [`DataError::BadHeader`] naming the file and the tensor.

use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::{DataError, Dataset, TrainTest};

/// Loads a data set file made as the module doc says.
pub fn load_tensor_file(path: &Path) -> Result<TrainTest, DataError> {
    let bytes = std::fs::read(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            DataError::MissingFile {
                path: path.to_path_buf(),
                hint: "pass the path of a safetensors file with train_x, train_y, test_x, test_y"
                    .into(),
            }
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    parse_tensor_file(&bytes, path)
}

/// Parses the bytes of a data set file (`path` only names it in errors).
pub fn parse_tensor_file(bytes: &[u8], path: &Path) -> Result<TrainTest, DataError> {
    let bad = |detail: String| DataError::BadHeader {
        path: path.to_path_buf(),
        detail,
    };
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| bad(format!("not a readable safetensors file: {e}")))?;
    let get = |name: &str| {
        file.tensor(name).map_err(|_| {
            let mut have: Vec<&str> = file.names().into_iter().collect();
            have.sort();
            bad(format!(
                "no tensor `{name}` (it has: {}); a data set file holds train_x, train_y, test_x, test_y",
                have.join(", ")
            ))
        })
    };
    let (train_x, train_shape) = features(&get("train_x")?, "train_x").map_err(&bad)?;
    let (test_x, test_shape) = features(&get("test_x")?, "test_x").map_err(&bad)?;
    if train_shape[1..] != test_shape[1..] {
        return Err(bad(format!(
            "train_x samples have shape {:?} but test_x samples {:?}",
            &train_shape[1..],
            &test_shape[1..]
        )));
    }
    let train_y = labels(&get("train_y")?, "train_y", train_shape[0]).map_err(&bad)?;
    let test_y = labels(&get("test_y")?, "test_y", test_shape[0]).map_err(&bad)?;
    if train_y.is_empty() || test_y.is_empty() {
        return Err(bad("train and test need at least one sample each".into()));
    }
    let classes = train_y.iter().chain(&test_y).copied().max().unwrap_or(0) as usize + 1;
    if classes < 2 {
        return Err(bad("the labels hold a single class".into()));
    }
    let name = path
        .file_stem()
        .map_or("tensors".into(), |s| s.to_string_lossy().into_owned());
    let sample_shape = train_shape[1..].to_vec();
    Ok(TrainTest {
        train: Dataset {
            name: format!("{name}-train"),
            sample_shape: sample_shape.clone(),
            features: train_x.into(),
            labels: train_y,
            classes,
        },
        test: Dataset {
            name: format!("{name}-test"),
            sample_shape,
            features: test_x.into(),
            labels: test_y,
            classes,
        },
    })
}

fn features(view: &TensorView<'_>, name: &str) -> Result<(Vec<f32>, Vec<usize>), String> {
    let shape = view.shape().to_vec();
    if shape.len() < 2 || shape.contains(&0) {
        return Err(format!(
            "`{name}` has shape {shape:?}: expected [samples, ...sample shape] with no zero dimension"
        ));
    }
    let values: Vec<f32> = match view.dtype() {
        Dtype::F32 => view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::U8 => view.data().iter().map(|&b| f32::from(b) / 255.0).collect(),
        other => {
            return Err(format!(
                "`{name}` is {other:?}: expected F32 or U8 (convert with `.float()`)"
            ))
        }
    };
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(format!("`{name}` holds a non-finite value at element {i}"));
    }
    Ok((values, shape))
}

fn labels(view: &TensorView<'_>, name: &str, samples: usize) -> Result<Vec<u32>, String> {
    if view.shape() != [samples] {
        return Err(format!(
            "`{name}` has shape {:?}: expected [{samples}] (one class index per sample)",
            view.shape()
        ));
    }
    let d = view.data();
    let wide: Vec<i64> = match view.dtype() {
        Dtype::I64 => d
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect(),
        Dtype::I32 => d
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        Dtype::U32 => d
            .chunks_exact(4)
            .map(|b| i64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        Dtype::U8 => d.iter().map(|&b| i64::from(b)).collect(),
        other => {
            return Err(format!(
                "`{name}` is {other:?}: expected integer class indices (I64, I32, U32 or U8)"
            ))
        }
    };
    const MAX_CLASSES: i64 = 1 << 20;
    wide.iter()
        .enumerate()
        .map(|(i, &l)| {
            if (0..MAX_CLASSES).contains(&l) {
                Ok(l as u32)
            } else {
                Err(format!(
                    "`{name}` sample {i} has label {l}: expected 0 ≤ label < {MAX_CLASSES}"
                ))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn file(
        x_shape: &[usize],
        x: &[f32],
        y: &[i64],
        extra_test_shape: Option<&[usize]>,
    ) -> Vec<u8> {
        let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let yb: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
        let test_shape = extra_test_shape.unwrap_or(x_shape).to_vec();
        let views = vec![
            (
                "train_x",
                TensorView::new(Dtype::F32, x_shape.to_vec(), &xb).unwrap(),
            ),
            (
                "train_y",
                TensorView::new(Dtype::I64, vec![y.len()], &yb).unwrap(),
            ),
            (
                "test_x",
                TensorView::new(Dtype::F32, test_shape, &xb).unwrap(),
            ),
            (
                "test_y",
                TensorView::new(Dtype::I64, vec![y.len()], &yb).unwrap(),
            ),
        ];
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn a_tensor_file_loads_with_its_shapes_and_classes() {
        let x: Vec<f32> = (0..3 * 4).map(|i| i as f32).collect();
        let tt = parse_tensor_file(
            &file(&[3, 1, 2, 2], &x, &[0, 4, 2], None),
            Path::new("t.safetensors"),
        )
        .unwrap();
        assert_eq!(tt.train.sample_shape, [1, 2, 2]);
        assert_eq!(tt.train.classes, 5);
        assert_eq!(tt.train.labels, [0, 4, 2]);
        assert_eq!(tt.test.features.to_vec(), x);
        assert_eq!(tt.train.name, "t-train");
    }

    #[test]
    fn bad_files_name_the_tensor_and_the_problem() {
        let x = vec![0.5f32; 6];
        let p = Path::new("d.safetensors");
        let e = parse_tensor_file(&file(&[3, 2], &x, &[0, 1], None), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("train_y") && e.contains("expected [3]"), "{e}");
        let e = parse_tensor_file(&file(&[3, 2], &x, &[0, 1, -1], None), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("label -1"), "{e}");
        let e = parse_tensor_file(&file(&[3, 2], &x, &[0, 1, 1], Some(&[2, 3])), p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train_x samples have shape [2] but test_x samples [3]"),
            "{e}"
        );
        let e = parse_tensor_file(b"garbage", p).unwrap_err().to_string();
        assert!(
            e.contains("d.safetensors") && e.contains("not a readable"),
            "{e}"
        );
        let only: Vec<u8> = safetensors::serialize(
            vec![(
                "train_x",
                TensorView::new(Dtype::F32, vec![3, 2], bytemuck::cast_slice(&x)).unwrap(),
            )],
            None,
        )
        .unwrap();
        let e = parse_tensor_file(&only, p).unwrap_err().to_string();
        assert!(e.contains("no tensor `test_x`"), "{e}");
        let e = load_tensor_file(Path::new("/nonexistent/d.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not found"), "{e}");
    }

    proptest! {
        #[test]
        fn garbage_never_panics(junk in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_tensor_file(&junk, Path::new("junk"));
        }
    }
}
