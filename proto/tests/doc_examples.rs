//! The examples of `docs/PROTOCOL.md` are what this crate writes: the frames of "Examples" are what
//! the encoder writes and decode back to their messages, and the hand-off ring bytes of "Ring
//! examples" are what `gpufeed_proto::ring` writes and reads back. (The document once showed version 1
//! frames, which a version 2 daemon refused, and nothing checked them.)

use std::ptr::NonNull;

use gpufeed_proto::protocol::{Backend, Device, DeviceUuid, Message, StreamSpec};
use gpufeed_proto::ring::{
    decode_batch, decode_header, decode_release, encode_batch, encode_release, ring_bytes,
    RingBatch, RingView,
};

/// The text of the section under the line `heading` (a `## ` heading), up to the next `## ` heading.
fn section(doc: &str, heading: &str) -> String {
    let mut lines = doc.lines().skip_while(|line| *line != heading);
    assert!(
        lines.next().is_some(),
        "docs/PROTOCOL.md has no {heading:?}"
    );
    lines
        .take_while(|line| !line.starts_with("## "))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The hex bytes of each fenced block of the section under `heading`; on each line, the first word
/// that is not a two-digit hex byte starts a comment.
fn example_blocks(heading: &str) -> Vec<Vec<u8>> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/PROTOCOL.md"))
        .expect("docs/PROTOCOL.md");
    let text = section(&doc, heading);
    let mut blocks = Vec::new();
    for (index, block) in text.split("```").enumerate() {
        if index % 2 == 0 {
            continue;
        }
        let mut bytes = Vec::new();
        for line in block.lines() {
            for token in line.split_whitespace() {
                match u8::from_str_radix(token, 16) {
                    Ok(byte) if token.len() == 2 => bytes.push(byte),
                    _ => break,
                }
            }
        }
        blocks.push(bytes);
    }
    blocks
}

fn le_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|word| word.to_le_bytes()).collect()
}

#[test]
fn the_documented_frames_are_the_encoders() {
    let messages = [
        vec![Message::Hello {
            client: "x".to_string(),
        }],
        vec![Message::Welcome {
            session: 1,
            backend: Backend::Cpu,
            daemon_version: "0.1.0".to_string(),
        }],
        vec![Message::EndOfEpoch { epoch: 0, steps: 2 }, Message::Close],
        vec![Message::OpenStream({
            let mut spec = StreamSpec::new("d", 8);
            spec.device = Device::Cuda(0);
            spec.device_uuid = Some(
                "GPU-5e1f0a42-9b3c-11ee-8001-a0369f123456"
                    .parse::<DeviceUuid>()
                    .unwrap(),
            );
            spec
        })],
    ];
    let documented = example_blocks("## Examples");
    assert_eq!(documented.len(), messages.len(), "example blocks");
    for (index, (doc, block)) in documented.iter().zip(&messages).enumerate() {
        let encoded: Vec<u8> = block.iter().flat_map(Message::encode).collect();
        assert_eq!(
            doc, &encoded,
            "example {index}: the document shows {doc:02x?}, the encoder writes {encoded:02x?}"
        );
        let mut rest = &doc[..];
        for message in block {
            let length = Message::frame_length(rest[..4].try_into().unwrap()).unwrap();
            assert_eq!(&Message::decode(&rest[4..4 + length]).unwrap(), message);
            rest = &rest[4 + length..];
        }
        assert!(
            rest.is_empty(),
            "example {index}: bytes after the last frame"
        );
    }
}

#[test]
fn the_documented_ring_bytes_are_the_rings() {
    const SLOTS: u32 = 4;
    let documented = example_blocks("## Ring examples");
    assert_eq!(
        documented.len(),
        3,
        "ring example blocks: header, batch entry, release entry"
    );

    // The header as a fresh ring of 4 slots has it.
    let mut region = vec![0u64; ring_bytes(SLOTS) / 8];
    // SAFETY: the vector is 8-byte aligned, `ring_bytes(SLOTS)` long, outlives the view, and is only
    // touched through the view, which is not used after this statement.
    let _ = unsafe { RingView::init(NonNull::new(region.as_mut_ptr().cast()).unwrap(), SLOTS) };
    let header = [region[0], region[1], region[2], region[3]];
    assert_eq!(
        documented[0],
        le_bytes(&header),
        "the header: the document shows {:02x?}",
        documented[0]
    );
    assert!(
        region[4..32].iter().all(|&word| word == 0),
        "the rest of a fresh header is zero"
    );
    assert_eq!(decode_header(header, ring_bytes(SLOTS)), Ok(SLOTS));

    // Batch entry 5.
    let batch = RingBatch {
        slot: 1,
        samples: 2,
        replaced: 1,
        epoch: 3,
        step: 5,
        cursor_after: 12,
        ready_ns: 1_000_000_000,
    };
    let words = encode_batch(5, &batch);
    assert_eq!(
        documented[1],
        le_bytes(&words),
        "batch entry 5: the document shows {:02x?}",
        documented[1]
    );
    assert_eq!(decode_batch(5, words, SLOTS), Ok(batch));

    // Release entry 5, of slot 1.
    let word = encode_release(5, 1);
    assert_eq!(word, 0x0000_0006_0000_0001);
    assert_eq!(
        documented[2],
        le_bytes(&[word]),
        "release entry 5: the document shows {:02x?}",
        documented[2]
    );
    assert_eq!(decode_release(5, word, SLOTS), Ok(1));
}
