//! The per-batch shapes of variable-length fields, read from their index tensors in the slot: the
//! lengths of a padded field give its `[samples, L, ...]` (`L` the longest), the cumulative
//! offsets of a packed field its `[total, ...]`. Every index value is checked against the layout's
//! bounds before a shape is made from it. In device memory the index is copied to the host first,
//! once the batch is ready (a wait for the batch on the host, per batch of such a stream).

use crate::protocol::{BatchForm, StreamLayout};

/// The shape of each field of a batch of `samples`: the batch dimension then the layout's sample
/// shape, except for variable-length fields and their index tensors, whose bytes `read` gives
/// (`read(offset, len)`: `len` bytes at `offset` of the batch's slot). An index that breaks the
/// layout's bounds is an error naming the field.
pub(super) fn batch_shapes(
    layout: &StreamLayout,
    read: impl Fn(u64, usize) -> Result<Vec<u8>, String>,
    samples: u32,
) -> Result<Vec<Vec<u64>>, String> {
    let samples = samples as usize;
    let mut shapes: Vec<Vec<u64>> = layout
        .fields
        .iter()
        .map(|field| {
            let mut shape = Vec::with_capacity(field.sample_shape.len() + 1);
            shape.push(samples as u64);
            shape.extend_from_slice(&field.sample_shape);
            shape
        })
        .collect();
    for variable in &layout.variable {
        let values = &layout.fields[usize::from(variable.values)];
        let index = &layout.fields[usize::from(variable.index)];
        let entries = match variable.form {
            BatchForm::Padded => samples,
            BatchForm::Packed => samples + 1,
        };
        if index.offset + 4 * entries as u64 > layout.slot_bytes {
            return Err(format!(
                "the index of {:?} lies beyond the slot",
                values.name
            ));
        }
        let bytes = read(index.offset, 4 * entries)?;
        let read = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4"));
        let bound = values.sample_shape[0];
        let element_shape = &values.sample_shape[1..];
        let bad = |what: String| format!("variable-length field {:?}: {what}", values.name);
        let leading = match variable.form {
            BatchForm::Padded => {
                let mut longest = 0u64;
                for i in 0..samples {
                    let length = read(i);
                    if length < 0 || length as u64 > bound {
                        return Err(bad(format!(
                            "sample {i} has length {length}, outside 0..={bound}"
                        )));
                    }
                    longest = longest.max(length as u64);
                }
                shapes[usize::from(variable.values)] = [samples as u64, longest]
                    .into_iter()
                    .chain(element_shape.iter().copied())
                    .collect();
                None
            }
            BatchForm::Packed => {
                if read(0) != 0 {
                    return Err(bad(format!("cu_seqlens starts at {}, not 0", read(0))));
                }
                for i in 0..samples {
                    let (from, to) = (read(i), read(i + 1));
                    if to < from || (to - from) as u64 > bound {
                        return Err(bad(format!(
                            "cu_seqlens {from}..{to} of sample {i} goes back or exceeds {bound}"
                        )));
                    }
                }
                Some(read(samples) as u64)
            }
        };
        if let Some(total) = leading {
            shapes[usize::from(variable.values)] = std::iter::once(total)
                .chain(element_shape.iter().copied())
                .collect();
        }
        shapes[usize::from(variable.index)] = vec![entries as u64];
    }
    Ok(shapes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::protocol::{Device, FieldLayout, VariableLayout};

    /// A layout of one variable-length field `t` (int32, bound 4, element shape [2]) in `form`, its
    /// index at byte 4096.
    fn layout(form: BatchForm) -> StreamLayout {
        StreamLayout {
            slot_count: 1,
            slot_bytes: 8192,
            slot_stride: 8192,
            epoch_samples: 10,
            steps: 1,
            fields: vec![
                FieldLayout {
                    name: "t".into(),
                    dtype: DType::I32,
                    sample_shape: vec![4, 2],
                    offset: 0,
                    batch_bytes: 3 * 4 * 2 * 4,
                },
                FieldLayout {
                    name: format!("t.{}", form.index_suffix()),
                    dtype: DType::I32,
                    sample_shape: vec![],
                    offset: 4096,
                    batch_bytes: 16,
                },
            ],
            device: Device::Cpu,
            slot_events: Vec::new(),
            variable: vec![VariableLayout {
                values: 0,
                index: 1,
                form,
            }],
        }
    }

    /// A reader of a slot whose index (at byte 4096) holds `index`.
    fn slot(index: &[i32]) -> impl Fn(u64, usize) -> Result<Vec<u8>, String> {
        let mut slot = vec![0u8; 8192];
        for (i, v) in index.iter().enumerate() {
            slot[4096 + 4 * i..4096 + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        move |at, len| Ok(slot[at as usize..at as usize + len].to_vec())
    }

    #[test]
    fn shapes_follow_the_index() {
        let padded = batch_shapes(&layout(BatchForm::Padded), slot(&[1, 3, 0]), 3);
        assert_eq!(padded.unwrap(), vec![vec![3, 3, 2], vec![3]]);
        let packed = batch_shapes(&layout(BatchForm::Packed), slot(&[0, 1, 4, 4]), 3);
        assert_eq!(packed.unwrap(), vec![vec![4, 2], vec![4]]);
    }

    /// An index the daemon wrote wrong (a length beyond the layout's bound or negative, cumulative
    /// offsets that go back or do not start at 0) is a protocol violation naming the field, not a
    /// shape that reads beyond the field's bytes.
    #[test]
    fn an_index_beyond_the_bounds_is_refused() {
        let cases = [
            (BatchForm::Padded, vec![1, 5, 0], "sample 1 has length 5"),
            (BatchForm::Padded, vec![-1, 0, 0], "length -1"),
            (BatchForm::Packed, vec![1, 1, 2, 3], "starts at 1"),
            (BatchForm::Packed, vec![0, 3, 2, 2], "goes back"),
            (BatchForm::Packed, vec![0, 0, 5, 5], "exceeds 4"),
        ];
        for (form, index, expected) in cases {
            let error = batch_shapes(&layout(form), slot(&index), 3).unwrap_err();
            assert!(
                error.contains("\"t\"") && error.contains(expected),
                "{error}"
            );
        }
    }
}
