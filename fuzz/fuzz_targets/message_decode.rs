//! Fuzzes the wire protocol's decoder (`Message::decode`, after `Message::frame_length`): no input
//! panics, and what decodes survives an encode / decode round trip unchanged
//! (`Message::check_decode`, which CI's stable fuzz smoke test drives with proptest too).
#![no_main]

use gpufeed_client::protocol::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= 4 {
        if let Ok(length) = Message::frame_length(data[..4].try_into().unwrap()) {
            let end = (4 + length).min(data.len());
            Message::check_decode(&data[4..end]);
        }
    }
    Message::check_decode(data);
});
