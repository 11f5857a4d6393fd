//! safetensors inputs: one tensor of a `.safetensors` file as a field, axis 0 being samples.
//!
//! Layout (see the `safetensors` crate): an 8-byte little-endian header length `n`, `n` bytes of
//! JSON mapping tensor names to dtype, shape and `data_offsets` relative to the end of the header,
//! then the tensor data, little-endian and in C order. We let the crate validate the header and
//! keep a zero-copy view of the tensor's bytes inside our own mapping.

use std::path::Path;

use ::safetensors::tensor::{Dtype, SafeTensorError, SafeTensors};
use gpufeed_proto::DType;

use super::{checked_sample_bytes, map_file, split_shape, FieldSource, InputError, SourcePart};

/// Size of the header-length prefix.
const LEN_PREFIX: usize = 8;

/// The crate's limit on header size; a larger length field means "not a safetensors file" rather
/// than "truncated", so we leave that case to the crate's error.
const MAX_HEADER_LEN: u64 = 100_000_000;

/// How many tensor names [`InputError::TensorNotFound`] lists; checkpoints can hold thousands.
const MAX_LISTED_NAMES: usize = 20;

/// Opens one tensor of a `.safetensors` file as a field (axis 0 = samples).
pub fn open_safetensors_field(
    name: &str,
    path: &Path,
    tensor: &str,
) -> Result<FieldSource, InputError> {
    let backing = map_file(path)?;
    let bytes = backing.bytes();
    check_header_fits(path, bytes)?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(bytes).map_err(|e| metadata_error(path, bytes, e))?;
    let Some(info) = metadata.info(tensor) else {
        let mut names: Vec<String> = metadata.tensors().into_keys().collect();
        names.sort();
        let omitted = names.len().saturating_sub(MAX_LISTED_NAMES);
        names.truncate(MAX_LISTED_NAMES);
        return Err(InputError::TensorNotFound {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
            available: names,
            omitted,
        });
    };
    let dtype = map_dtype(path, info.dtype)?;
    let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
    let (samples, sample_shape) = split_shape(path, &shape)?;
    let overflow = || InputError::ShapeOverflow {
        path: path.to_path_buf(),
        shape: shape.clone(),
    };
    let sample_bytes = checked_sample_bytes(dtype, &sample_shape).ok_or_else(overflow)?;
    let data_offset = LEN_PREFIX
        .checked_add(header_len)
        .and_then(|n| n.checked_add(info.data_offsets.0))
        .ok_or_else(overflow)?;
    // The crate checked that the offsets span exactly shape * dtype bytes and that the last tensor
    // ends at the end of the file; `SourcePart::new` re-checks the bounds for our own slicing.
    let part = SourcePart::new(path, backing.clone(), data_offset, samples, sample_bytes)?;
    Ok(FieldSource {
        name: name.to_string(),
        dtype,
        sample_shape,
        parts: vec![part],
    })
}

/// Reports a file cut short inside its header as [`InputError::Truncated`]; the crate would only
/// say "invalid header length".
fn check_header_fits(path: &Path, bytes: &[u8]) -> Result<(), InputError> {
    let actual = bytes.len() as u64;
    let Some(prefix) = bytes.get(..LEN_PREFIX) else {
        return Err(InputError::Truncated {
            path: path.to_path_buf(),
            expected_bytes: LEN_PREFIX as u64,
            actual_bytes: actual,
        });
    };
    let mut len = [0u8; LEN_PREFIX];
    len.copy_from_slice(prefix);
    let header_len = u64::from_le_bytes(len);
    if header_len <= MAX_HEADER_LEN && LEN_PREFIX as u64 + header_len > actual {
        return Err(InputError::Truncated {
            path: path.to_path_buf(),
            expected_bytes: LEN_PREFIX as u64 + header_len,
            actual_bytes: actual,
        });
    }
    Ok(())
}

/// Converts a crate error to ours. When the data section does not end at the end of the file,
/// re-reads the header to say whether the file is truncated or has trailing bytes, and by how much.
fn metadata_error(path: &Path, bytes: &[u8], error: SafeTensorError) -> InputError {
    if matches!(error, SafeTensorError::MetadataIncompleteBuffer) {
        if let Some(expected) = expected_file_len(bytes) {
            let actual = bytes.len() as u64;
            if expected > actual {
                return InputError::Truncated {
                    path: path.to_path_buf(),
                    expected_bytes: expected,
                    actual_bytes: actual,
                };
            }
            if expected < actual {
                return InputError::TrailingBytes {
                    path: path.to_path_buf(),
                    expected_bytes: expected,
                    actual_bytes: actual,
                };
            }
        }
    }
    InputError::Safetensors {
        path: path.to_path_buf(),
        reason: error.to_string(),
    }
}

/// File length implied by the header: prefix + header + the largest tensor end offset. `None` if
/// the header cannot be read (the crate's own error is then the better report).
fn expected_file_len(bytes: &[u8]) -> Option<u64> {
    let mut len = [0u8; LEN_PREFIX];
    len.copy_from_slice(bytes.get(..LEN_PREFIX)?);
    let header_len = usize::try_from(u64::from_le_bytes(len)).ok()?;
    let header = bytes.get(LEN_PREFIX..LEN_PREFIX.checked_add(header_len)?)?;
    let json: serde_json::Value = serde_json::from_slice(header).ok()?;
    let data_end = json
        .as_object()?
        .iter()
        .filter(|(key, _)| key.as_str() != "__metadata__")
        .filter_map(|(_, info)| info.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    (LEN_PREFIX as u64)
        .checked_add(header_len as u64)?
        .checked_add(data_end)
}

/// Maps a safetensors dtype to ours; the rest are refused naming the dtype.
fn map_dtype(path: &Path, dtype: Dtype) -> Result<DType, InputError> {
    let detail = match dtype {
        Dtype::U8 => return Ok(DType::U8),
        Dtype::I8 => return Ok(DType::I8),
        Dtype::U16 => return Ok(DType::U16),
        Dtype::I16 => return Ok(DType::I16),
        Dtype::U32 => return Ok(DType::U32),
        Dtype::I32 => return Ok(DType::I32),
        Dtype::U64 => return Ok(DType::U64),
        Dtype::I64 => return Ok(DType::I64),
        Dtype::F16 => return Ok(DType::F16),
        Dtype::BF16 => return Ok(DType::BF16),
        Dtype::F32 => return Ok(DType::F32),
        Dtype::F64 => return Ok(DType::F64),
        Dtype::BOOL => "booleans are not supported; store them as U8",
        Dtype::C64 => "complex numbers are not supported",
        // F4, F6_*, F8_* and whatever future versions of the format add.
        _ => "only U8 I8 U16 I16 U32 I32 U64 I64 F16 BF16 F32 F64 are supported",
    };
    Err(InputError::UnsupportedDtype {
        path: path.to_path_buf(),
        descr: dtype.to_string(),
        detail: detail.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::safetensors::tensor::TensorView;
    use std::path::PathBuf;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect()
    }

    /// Serializes `(name, dtype, shape, data)` tensors into a `.safetensors` file in `dir`.
    fn write_file(
        dir: &tempfile::TempDir,
        file: &str,
        tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)],
    ) -> PathBuf {
        let views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .map(|(name, dtype, shape, data)| {
                (*name, TensorView::new(*dtype, shape.clone(), data).unwrap())
            })
            .collect();
        let bytes = ::safetensors::serialize(views, None).unwrap();
        let path = dir.path().join(file);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn all_bytes(field: &FieldSource) -> Vec<u8> {
        let mut out = Vec::new();
        field.copy_samples(0, field.sample_count(), &mut out);
        out
    }

    #[test]
    fn opens_a_tensor_among_several() {
        let dir = tempfile::tempdir().unwrap();
        let a = pattern(3 * 2 * 4, 1);
        let b = pattern(5 * 2 * 3 * 2, 2);
        let path = write_file(
            &dir,
            "m.safetensors",
            &[
                ("a", Dtype::F32, vec![3, 2], a.clone()),
                ("b", Dtype::BF16, vec![5, 2, 3], b.clone()),
            ],
        );
        let field = open_safetensors_field("img", &path, "b").unwrap();
        assert_eq!(field.name, "img");
        assert_eq!(field.dtype, DType::BF16);
        assert_eq!(field.sample_shape, vec![2, 3]);
        assert_eq!(field.sample_count(), 5);
        assert_eq!(field.sample_bytes(), 12);
        assert_eq!(all_bytes(&field), b);
        let mut out = Vec::new();
        field.copy_samples(1, 2, &mut out);
        assert_eq!(out, b[12..36]);
        assert_eq!(field.paths(), vec![path.as_path()]);

        let field = open_safetensors_field("x", &path, "a").unwrap();
        assert_eq!(field.dtype, DType::F32);
        assert_eq!(all_bytes(&field), a);
    }

    #[test]
    fn maps_every_supported_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            (Dtype::U8, DType::U8),
            (Dtype::I8, DType::I8),
            (Dtype::U16, DType::U16),
            (Dtype::I16, DType::I16),
            (Dtype::U32, DType::U32),
            (Dtype::I32, DType::I32),
            (Dtype::U64, DType::U64),
            (Dtype::I64, DType::I64),
            (Dtype::F16, DType::F16),
            (Dtype::BF16, DType::BF16),
            (Dtype::F32, DType::F32),
            (Dtype::F64, DType::F64),
        ];
        for (i, (st, ours)) in cases.into_iter().enumerate() {
            let data = pattern(4 * ours.size_bytes(), i as u8);
            let path = write_file(
                &dir,
                &format!("{i}.st"),
                &[("t", st, vec![4], data.clone())],
            );
            let field = open_safetensors_field("f", &path, "t").unwrap();
            assert_eq!(field.dtype, ours);
            assert!(field.sample_shape.is_empty());
            assert_eq!(field.sample_count(), 4);
            assert_eq!(all_bytes(&field), data);
        }
    }

    #[test]
    fn missing_tensor_lists_sorted_names() {
        let dir = tempfile::tempdir().unwrap();
        let tensors: Vec<(String, Vec<u8>)> = (0..25)
            .map(|i| (format!("t{i:02}"), vec![i as u8]))
            .collect();
        let specs: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .rev()
            .map(|(n, d)| (n.as_str(), Dtype::U8, vec![1], d.clone()))
            .collect();
        let path = write_file(&dir, "many.st", &specs);
        let err = open_safetensors_field("f", &path, "nope").unwrap_err();
        match &err {
            InputError::TensorNotFound {
                path: p,
                tensor,
                available,
                omitted,
            } => {
                assert_eq!(p, &path);
                assert_eq!(tensor, "nope");
                let expected: Vec<String> = (0..20).map(|i| format!("t{i:02}")).collect();
                assert_eq!(available, &expected);
                assert_eq!(*omitted, 5);
            }
            other => panic!("{other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("many.st") && msg.contains("t00") && msg.contains("5 more"),
            "{msg}"
        );

        let path = write_file(&dir, "one.st", &[("x", Dtype::U8, vec![1], vec![0])]);
        let err = open_safetensors_field("f", &path, "y").unwrap_err();
        assert!(err.to_string().ends_with("available: x"), "{err}");
    }

    #[test]
    fn unsupported_dtypes_are_named() {
        let dir = tempfile::tempdir().unwrap();
        for (dtype, name) in [
            (Dtype::BOOL, "BOOL"),
            (Dtype::F8_E4M3, "F8_E4M3"),
            (Dtype::C64, "C64"),
        ] {
            let size = dtype.bitsize() / 8;
            let path = write_file(&dir, "u.st", &[("t", dtype, vec![2], vec![0; 2 * size])]);
            let err = open_safetensors_field("f", &path, "t").unwrap_err();
            assert!(
                matches!(&err, InputError::UnsupportedDtype { path: p, descr, .. } if *p == path && descr == name),
                "{err}"
            );
        }
    }

    #[test]
    fn shape_edge_cases() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(
            &dir,
            "s.st",
            &[
                ("scalar", Dtype::F32, vec![], vec![0; 4]),
                ("empty_sample", Dtype::F32, vec![3, 0], vec![]),
                ("no_samples", Dtype::F32, vec![0, 4], vec![]),
            ],
        );
        let err = open_safetensors_field("f", &path, "scalar").unwrap_err();
        assert!(matches!(err, InputError::ScalarArray { .. }), "{err}");
        let err = open_safetensors_field("f", &path, "empty_sample").unwrap_err();
        assert!(matches!(err, InputError::EmptySample { .. }), "{err}");
        let field = open_safetensors_field("f", &path, "no_samples").unwrap();
        assert_eq!(field.sample_count(), 0);
        assert_eq!(field.sample_shape, vec![4]);
        assert!(all_bytes(&field).is_empty());
    }

    #[test]
    fn truncated_and_trailing_files_are_detected() {
        let dir = tempfile::tempdir().unwrap();
        let good = write_file(&dir, "g.st", &[("t", Dtype::U16, vec![4, 2], vec![0; 16])]);
        let full = std::fs::read(&good).unwrap();

        let path = dir.path().join("t.st");
        std::fs::write(&path, &full[..full.len() - 3]).unwrap();
        let err = open_safetensors_field("f", &path, "t").unwrap_err();
        match &err {
            InputError::Truncated {
                path: p,
                expected_bytes,
                actual_bytes,
            } => {
                assert_eq!(p, &path);
                assert_eq!(*expected_bytes, full.len() as u64);
                assert_eq!(*actual_bytes, full.len() as u64 - 3);
            }
            other => panic!("{other}"),
        }

        for cut in [0, 5, 20] {
            std::fs::write(&path, &full[..cut]).unwrap();
            let err = open_safetensors_field("f", &path, "t").unwrap_err();
            assert!(
                matches!(err, InputError::Truncated { .. }),
                "cut {cut}: {err}"
            );
        }

        let mut long = full.clone();
        long.extend_from_slice(&[0; 5]);
        std::fs::write(&path, &long).unwrap();
        let err = open_safetensors_field("f", &path, "t").unwrap_err();
        assert!(matches!(err, InputError::TrailingBytes { .. }), "{err}");
    }

    #[test]
    fn garbage_and_missing_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.st");
        std::fs::write(&path, b"this is definitely not a safetensors file").unwrap();
        let err = open_safetensors_field("f", &path, "t").unwrap_err();
        assert!(
            matches!(&err, InputError::Safetensors { path: p, .. } if *p == path),
            "{err}"
        );

        let mut bad_json = 10u64.to_le_bytes().to_vec();
        bad_json.extend_from_slice(b"{not json}");
        std::fs::write(&path, &bad_json).unwrap();
        let err = open_safetensors_field("f", &path, "t").unwrap_err();
        assert!(matches!(err, InputError::Safetensors { .. }), "{err}");
        assert!(err.to_string().contains("g.st"), "{err}");

        let missing = dir.path().join("missing.st");
        let err = open_safetensors_field("f", &missing, "t").unwrap_err();
        assert!(
            matches!(&err, InputError::Io { path: p, .. } if *p == missing),
            "{err}"
        );
    }
}
