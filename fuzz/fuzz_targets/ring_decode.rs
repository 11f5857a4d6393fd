//! Fuzzes the hand-off ring's readers (`gpufeed_proto::ring::check_decode_region`): a region of
//! hostile bytes, attached, counted and decoded as the daemon and the consumer read it, never
//! panics, never reads outside the region, and what decodes encodes back to the same words. The
//! first 8 bytes of the input are the reader's position; the rest is the region.
#![no_main]

use gpufeed_client::ring::check_decode_region;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let seen = u64::from_le_bytes(data[..8].try_into().unwrap()) % (1 << 40);
    check_decode_region(&data[8..], seen);
});
