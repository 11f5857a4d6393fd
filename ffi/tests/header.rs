//! `include/gpufeed.h` is what cbindgen makes of `src/lib.rs` with `cbindgen.toml`: a change to the
//! C ABI that was not carried into the checked-in header fails here. `GPUFEED_BLESS=1 cargo test -p
//! gpufeed-ffi --test header` writes it.

use std::path::PathBuf;

#[test]
fn the_checked_in_header_is_current() {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = crate_dir.join("include/gpufeed.h");
    if std::env::var_os("GPUFEED_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write the header");
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "{} is stale: run `GPUFEED_BLESS=1 cargo test -p gpufeed-ffi --test header` and commit it",
        path.display()
    );
}
