//! Fuzzes the `.npy` header parser (`input::npy::parse_header`).
#![no_main]

use std::path::Path;

use gpufeed::input::npy::parse_header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = parse_header(Path::new("fuzz.npy"), data) {
        assert!(matches!(header.version, (1, 0) | (2, 0) | (3, 0)));
        assert!(
            header.data_offset <= data.len(),
            "data offset past the bytes given"
        );
        let prefix = if header.version.0 == 1 { 10 } else { 12 };
        assert!(header.data_offset >= prefix);
        let _ = header.data_bytes();
    }
});
