//! Regression test: a stream whose batch (times the world size) is larger than the dataset, with the
//! default tail policy `drop`, served zero batches and ended the epoch at once, silently; `gpufeed
//! demo --samples 10` then printed "every served value equals the source" having checked nothing.
//! Such a stream is now refused when it opens, naming the sizes, and the demo fails with it.

mod common;

use common::{assert_fails, gpufeed};

#[test]
fn a_batch_larger_than_the_dataset_is_refused_at_open() {
    let err = assert_fails(&gpufeed(["demo", "--samples", "10", "--device", "cpu"]));
    assert!(
        err.contains("more than the dataset's 10 samples")
            && err.contains("no batch would be served"),
        "{err}"
    );
    assert!(
        !err.contains("every served value equals the source"),
        "{err}"
    );
}
