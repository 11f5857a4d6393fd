//! Fuzzes `Manifest::from_json`; on success the manifest must satisfy its documented invariants and
//! survive a `to_json` / `from_json` round trip unchanged.
#![no_main]

use std::path::Path;

use gpufeed::format::{validate_dataset_name, validate_field_name, Manifest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(manifest) = Manifest::from_json(Path::new("manifest.json"), data) else {
        return;
    };
    validate_dataset_name(&manifest.name).expect("valid dataset name");
    assert!(!manifest.fields.is_empty());
    for (index, field) in manifest.fields.iter().enumerate() {
        validate_field_name(&field.name).expect("valid field name");
        assert!(manifest.fields[..index]
            .iter()
            .all(|f| f.name != field.name));
        let sample_bytes = field
            .shape
            .iter()
            .try_fold(field.dtype.size_bytes() as u64, |acc, &d| {
                acc.checked_mul(d)
            })
            .expect("sample bytes fit in u64");
        assert!(sample_bytes > 0);
    }
    assert!(!manifest.shards.is_empty());
    let mut next = 0u64;
    for (index, shard) in manifest.shards.iter().enumerate() {
        assert!(!shard.file.is_empty() && !shard.file.starts_with('.'));
        assert!(!shard.file.contains(['/', '\\', '\0']));
        assert_eq!(shard.first_sample, next);
        assert!(shard.sample_count > 0);
        next = next
            .checked_add(shard.sample_count)
            .expect("sample count overflows");
        // A shard path must stay inside the dataset directory.
        let path = manifest.shard_path(Path::new("/d"), index);
        assert_eq!(path.parent(), Some(Path::new("/d")));
    }
    assert_eq!(next, manifest.sample_count);
    let again = Manifest::from_json(Path::new("manifest.json"), manifest.to_json().as_bytes())
        .expect("to_json output parses");
    assert_eq!(again, manifest);
});
