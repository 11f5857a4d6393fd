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
    // Our checks first: they refuse what the crate refuses, naming the tensor at fault, and also a
    // name given twice, which the crate takes silently (the last one wins).
    let checked = match header_of(bytes) {
        Some(header) => check_header(path, header, bytes.len() as u64).map(drop),
        None => Ok(()),
    };
    let read = checked.and_then(|()| {
        SafeTensors::read_metadata(bytes).map_err(|e| metadata_error(path, bytes, e))
    });
    // The header was read from the mapping: if the file was cut meanwhile, what was read may be
    // zeros, and the error to report is that.
    backing.check(path)?;
    let (header_len, metadata) = read?;
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
        ends: None,
    })
}

/// The JSON header of a safetensors file whose header length is within the crate's limit and whose
/// header fits the file (see [`check_header_fits`]); `None` otherwise.
fn header_of(bytes: &[u8]) -> Option<&[u8]> {
    let mut len = [0u8; LEN_PREFIX];
    len.copy_from_slice(bytes.get(..LEN_PREFIX)?);
    let header_len = u64::from_le_bytes(len);
    if header_len > MAX_HEADER_LEN {
        return None;
    }
    bytes.get(LEN_PREFIX..LEN_PREFIX + header_len as usize)
}

/// A tensor of a safetensors header that [`check_header`] found packable as far as the format goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderTensor {
    /// The tensor's name.
    pub name: String,
    /// Its element type, as the format names it.
    pub dtype: Dtype,
    /// Its full shape.
    pub shape: Vec<u64>,
    /// Its bytes in the data section (after the header): begin, end.
    pub data_offsets: (u64, u64),
}

/// Checks the JSON `header` of a safetensors file of `file_bytes` bytes by the rules the format
/// sets (those the `safetensors` crate applies when a tensor is packed) and one more, and returns its
/// tensors sorted by name. Each failure names the tensor at fault: a key given twice (at any
/// level; the crate would keep the last silently), a dtype the format does not know, a shape whose
/// byte size overflows or is not a whole number of bytes, data offsets reversed or not matching the
/// shape, tensors that overlap or leave bytes between them, and offsets beyond the file's end
/// ([`InputError::Truncated`]) or short of it ([`InputError::TrailingBytes`]). The crate refuses the
/// whole file for any of these, so the file is refused, not the tensor.
pub fn check_header(
    path: &Path,
    header: &[u8],
    file_bytes: u64,
) -> Result<Vec<HeaderTensor>, InputError> {
    use serde::de::DeserializeSeed;
    let data_start = LEN_PREFIX as u64 + header.len() as u64;
    let data_bytes = file_bytes.saturating_sub(data_start);
    let duplicate = std::cell::RefCell::new(None);
    let mut deserializer = serde_json::Deserializer::from_slice(header);
    let parsed = UniqueKeys {
        duplicate: &duplicate,
    }
    .deserialize(&mut deserializer)
    .and_then(|value| deserializer.end().map(|()| value));
    if let Some(key) = duplicate.into_inner() {
        return Err(InputError::DuplicateKey {
            path: path.to_path_buf(),
            key,
        });
    }
    let bad_file = |reason: String| InputError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    let serde_json::Value::Object(entries) = parsed.map_err(|e| bad_file(e.to_string()))? else {
        return Err(bad_file("the header is not a JSON object".to_string()));
    };
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, info) in &entries {
        if name == "__metadata__" {
            continue;
        }
        let bad = |reason: String| InputError::BadTensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            reason,
        };
        let dtype_name = info
            .get("dtype")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad("no dtype".to_string()))?;
        let dtype: Dtype = serde_json::from_value(serde_json::Value::from(dtype_name))
            .map_err(|_| bad(format!("dtype {dtype_name:?} is not a safetensors dtype")))?;
        let shape = info
            .get("shape")
            .and_then(serde_json::Value::as_array)
            .and_then(|dims| {
                dims.iter()
                    .map(serde_json::Value::as_u64)
                    .collect::<Option<Vec<u64>>>()
            })
            .ok_or_else(|| bad("no valid shape (a list of whole numbers)".to_string()))?;
        let (begin, end) = match info
            .get("data_offsets")
            .and_then(serde_json::Value::as_array)
            .map(|o| o.iter().map(serde_json::Value::as_u64).collect::<Vec<_>>())
            .as_deref()
        {
            Some(&[Some(begin), Some(end)]) => (begin, end),
            _ => return Err(bad("no valid data_offsets (two whole numbers)".to_string())),
        };
        if begin > end {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] are reversed (the tensor would end before it begins)"
            )));
        }
        let bits = shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .filter(|&n| usize::try_from(n).is_ok())
            .and_then(|n| n.checked_mul(dtype.bitsize() as u64))
            .ok_or_else(|| {
                bad(format!(
                    "shape {shape:?} of {dtype} overflows: its size does not fit in 64 bits"
                ))
            })?;
        if bits % 8 != 0 {
            return Err(bad(format!(
                "shape {shape:?} of {dtype} is not a whole number of bytes"
            )));
        }
        if end - begin != bits / 8 {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] hold {} bytes but shape {shape:?} of {dtype} is {} bytes",
                end - begin,
                bits / 8
            )));
        }
        tensors.push(HeaderTensor {
            name: name.clone(),
            dtype,
            shape,
            data_offsets: (begin, end),
        });
    }
    let mut by_offset: Vec<&HeaderTensor> = tensors.iter().collect();
    by_offset.sort_by_key(|t| (t.data_offsets, t.name.as_str()));
    let mut covered = 0u64;
    let mut previous: Option<&HeaderTensor> = None;
    for tensor in by_offset {
        let (begin, end) = tensor.data_offsets;
        let bad = |reason: String| InputError::BadTensor {
            path: path.to_path_buf(),
            tensor: tensor.name.clone(),
            reason,
        };
        if begin < covered {
            let other = previous.expect("something covers bytes before this tensor");
            return Err(bad(format!(
                "its bytes {begin}..{end} overlap tensor {:?} (bytes {}..{})",
                other.name, other.data_offsets.0, other.data_offsets.1
            )));
        }
        if begin > covered {
            return Err(bad(format!(
                "it starts at byte {begin} of the data section but the tensors before it end at \
                 {covered}: the format requires tensors to lie back to back"
            )));
        }
        covered = end;
        previous = Some(tensor);
    }
    if covered > data_bytes {
        return Err(InputError::Truncated {
            path: path.to_path_buf(),
            expected_bytes: data_start.saturating_add(covered),
            actual_bytes: file_bytes,
        });
    }
    if covered < data_bytes {
        return Err(InputError::TrailingBytes {
            path: path.to_path_buf(),
            expected_bytes: data_start + covered,
            actual_bytes: file_bytes,
        });
    }
    Ok(tensors)
}

/// Deserialises JSON into a [`serde_json::Value`] like `serde_json` does, except that a key given
/// twice in one object is an error (recorded in `duplicate`) instead of the last one winning.
#[derive(Clone, Copy)]
struct UniqueKeys<'a> {
    duplicate: &'a std::cell::RefCell<Option<String>>,
}

impl<'de> serde::de::DeserializeSeed<'de> for UniqueKeys<'_> {
    type Value = serde_json::Value;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueKeys<'_> {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut values = Vec::new();
        while let Some(value) = seq.next_element_seed(self)? {
            values.push(value);
        }
        Ok(serde_json::Value::Array(values))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                *self.duplicate.borrow_mut() = Some(key.clone());
                return Err(serde::de::Error::custom(format!("key {key:?} given twice")));
            }
            let value = map.next_value_seed(self)?;
            object.insert(key, value);
        }
        Ok(serde_json::Value::Object(object))
    }
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
        field
            .copy_samples(0, field.sample_count(), &mut out)
            .unwrap();
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
        field.copy_samples(1, 2, &mut out).unwrap();
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
