//! The example frames of `docs/PROTOCOL.md` ("Examples") are what this crate encodes, and decode
//! back to their messages: the document showed version 1 frames, which a version 2 daemon refuses,
//! and nothing checked them.

use gpufeed_proto::protocol::{Backend, BatchField, BatchInfo, Message};
use gpufeed_proto::DType;

/// The hex bytes of each fenced block of the Examples section; on each line, the first word that is
/// not a two-digit hex byte starts a comment.
fn example_blocks() -> Vec<Vec<u8>> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/PROTOCOL.md"))
        .expect("docs/PROTOCOL.md");
    let examples = doc
        .split("## Examples")
        .nth(1)
        .expect("an Examples section");
    let mut blocks = Vec::new();
    for (index, block) in examples.split("```").enumerate() {
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
        vec![Message::Batch(BatchInfo {
            slot: 0,
            epoch: 0,
            step: 0,
            cursor_after: 2,
            samples: 2,
            replaced: 0,
            fields: vec![BatchField {
                offset: 0,
                dtype: DType::U8,
                shape: vec![2, 4],
            }],
            ready_ns: 0,
        })],
        vec![Message::Release { slot: 3 }, Message::Close],
    ];
    let documented = example_blocks();
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
    }
}
