//! The checks of a variable-length field's offsets (format version 2), which live in block
//! payloads: the tables alone cannot say whether they are sound, so whoever reads them checks them
//! here before using them.
//!
//! A shard's offsets of a field are `sample_count` u64 values, entry `i` the end of sample `i`'s
//! values, counted in elements from the start of the shard's values region; sample `i`'s values
//! are elements `[end[i - 1], end[i])`, with `end[-1] = 0`.

use std::path::Path;

use super::{BlockEntry, FormatError, OFFSET_BYTES};

/// Checks the offsets `ends` of field `field` in the shard at `path` (whose first sample is
/// `first_sample` and whose values region holds `values_elements` elements): they never go back,
/// the last ends exactly at the end of the values, and no sample is longer than `length_max`
/// elements (the manifest's). The error names the file, the field and the sample (its index in the
/// dataset).
pub fn check_offsets(
    path: &Path,
    field: &str,
    first_sample: u64,
    ends: &[u64],
    values_elements: u64,
    length_max: u64,
) -> Result<(), FormatError> {
    let invalid = |sample: usize, what: String| FormatError::Invalid {
        path: path.to_path_buf(),
        what: format!(
            "field '{field}', sample {}: {what}",
            first_sample + sample as u64
        ),
    };
    let mut start = 0u64;
    for (sample, &end) in ends.iter().enumerate() {
        if end < start {
            return Err(invalid(
                sample,
                format!("offsets go back (ends at element {end}, before its start {start})"),
            ));
        }
        if end > values_elements {
            return Err(invalid(
                sample,
                format!(
                    "offsets out of range: ends at element {end} of a values region of {values_elements}"
                ),
            ));
        }
        if end - start > length_max {
            return Err(invalid(
                sample,
                format!(
                    "{} elements, more than the manifest's length_max {length_max}",
                    end - start
                ),
            ));
        }
        start = end;
    }
    if start != values_elements {
        return Err(FormatError::Invalid {
            path: path.to_path_buf(),
            what: format!(
                "field '{field}': the offsets end at element {start} but the values region holds {values_elements}"
            ),
        });
    }
    Ok(())
}

/// The global index of the sample holding element `element` of a shard's values region, by the
/// offsets `ends` (checked with [`check_offsets`]): the first sample ending after it. What a values
/// block's `first_sample` must be.
pub fn values_first_sample(first_sample: u64, ends: &[u64], element: u64) -> u64 {
    first_sample + ends.partition_point(|&end| end <= element) as u64
}

/// Checks that every values block of a variable-length field (`blocks`: the field's blocks, offsets
/// first; `offset_blocks` of them) names the sample its first value belongs to, as the writer
/// records it.
pub fn check_values_blocks(
    path: &Path,
    field: &str,
    first_sample: u64,
    ends: &[u64],
    blocks: &[BlockEntry],
    offset_blocks: u32,
    element_bytes: u64,
) -> Result<(), FormatError> {
    let offsets_bytes = ends.len() as u64 * OFFSET_BYTES;
    for (index, block) in blocks.iter().enumerate().skip(offset_blocks as usize) {
        let element = (block.raw_offset - offsets_bytes) / element_bytes;
        let expected = values_first_sample(first_sample, ends, element);
        if block.first_sample != expected {
            return Err(FormatError::Invalid {
                path: path.to_path_buf(),
                what: format!(
                    "field '{field}' block {index}: first_sample is {} but its first value belongs to sample {expected}",
                    block.first_sample
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_that_go_back_or_overrun_name_the_sample() {
        let path = Path::new("shard-000001.gfs");
        check_offsets(path, "tokens", 100, &[2, 2, 5], 5, 3).unwrap();
        let back = check_offsets(path, "tokens", 100, &[2, 1, 5], 5, 9).unwrap_err();
        assert!(
            back.to_string().contains("shard-000001.gfs")
                && back.to_string().contains("field 'tokens', sample 101")
                && back.to_string().contains("go back"),
            "{back}"
        );
        let over = check_offsets(path, "tokens", 100, &[2, 7, 7], 5, 9).unwrap_err();
        assert!(over.to_string().contains("sample 101"), "{over}");
        assert!(over.to_string().contains("out of range"), "{over}");
        let long = check_offsets(path, "tokens", 0, &[2, 6], 6, 3).unwrap_err();
        assert!(long.to_string().contains("length_max 3"), "{long}");
        let short = check_offsets(path, "tokens", 0, &[2, 4], 6, 3).unwrap_err();
        assert!(short.to_string().contains("holds 6"), "{short}");
    }

    #[test]
    fn a_value_belongs_to_the_first_sample_ending_after_it() {
        // Samples of 2, 0, 3 elements.
        let ends = [2, 2, 5];
        assert_eq!(values_first_sample(10, &ends, 0), 10);
        assert_eq!(values_first_sample(10, &ends, 1), 10);
        assert_eq!(values_first_sample(10, &ends, 2), 12);
        assert_eq!(values_first_sample(10, &ends, 4), 12);
    }
}
