//! The fuzz smoke test that runs on stable Rust (CI has no nightly for cargo-fuzz): the properties of
//! `fuzz/fuzz_targets/message_decode.rs` (`Message::check_decode`) over random frame bodies and over
//! mutations (bit flips, truncations, extensions, splices) of valid frames of every message kind.
//! `PROPTEST_CASES` raises the case count (CI's fuzz step runs 20 000 per property).

use gpufeed_proto::protocol::{
    Backend, BatchForm, CorruptPolicy, DaemonStatus, Device, ErrorCode, FieldLayout, FieldRequest,
    Message, MixtureSource, Shuffle, StreamLayout, StreamSpec, Tail, VariableLayout,
    VariableRequest, PROTOCOL_VERSION,
};
use gpufeed_proto::spec::StreamState;
use gpufeed_proto::DType;
use proptest::prelude::*;

/// One valid frame body (without the length field) of each message kind.
fn valid_bodies() -> Vec<Vec<u8>> {
    let mut spec = StreamSpec::new("tokens", 32);
    spec.fields = vec![FieldRequest {
        name: "ids".into(),
        dtype: Some(DType::F32),
    }];
    spec.tail = Tail::Pad;
    spec.on_corrupt = CorruptPolicy::Replace;
    spec.device = Device::Cuda(1);
    spec.resume(&StreamState {
        dataset: "tokens".into(),
        sources: Vec::new(),
        mixture_epoch_samples: None,
        seed: 7,
        epoch: 2,
        shuffle: Shuffle::Full,
        world_size: 4,
        batch_size: 32,
        cursor: 640,
    })
    .expect("the spec leaves the order to the state");
    let layout = StreamLayout {
        slot_count: 2,
        slot_bytes: 8192,
        slot_stride: 8192,
        epoch_samples: 100,
        steps: 3,
        fields: vec![FieldLayout {
            name: "ids".into(),
            dtype: DType::I32,
            sample_shape: vec![4],
            offset: 0,
            batch_bytes: 512,
        }],
        device: Device::Cpu,
        slot_events: Vec::new(),
        variable: Vec::new(),
    };
    // Both extension records of OpenStream (a mixture's, then batch forms') on a CUDA device
    // without a UUID (its place written as zeros), and StreamOpened's record of variable-length
    // layouts.
    let mut extended = StreamSpec::mixture(
        vec![
            MixtureSource {
                dataset: "web".into(),
                weight: 0.75,
            },
            MixtureSource {
                dataset: "code".into(),
                weight: 0.25,
            },
        ],
        16,
    );
    extended.device = Device::Cuda(0);
    extended.mixture_epoch_samples = Some(1000);
    extended.variable = vec![
        VariableRequest {
            name: "tokens".into(),
            form: BatchForm::Packed,
            cap: Some(64),
        },
        VariableRequest {
            name: "mask".into(),
            form: BatchForm::Padded,
            cap: None,
        },
    ];
    let mut variable_layout = layout.clone();
    variable_layout.fields.push(FieldLayout {
        name: "ids.lengths".into(),
        dtype: DType::I32,
        sample_shape: vec![],
        offset: 4096,
        batch_bytes: 128,
    });
    variable_layout.variable = vec![VariableLayout {
        values: 0,
        index: 1,
        form: BatchForm::Padded,
    }];
    let messages = vec![
        Message::Hello {
            client: "fuzz".into(),
        },
        Message::Welcome {
            session: 9,
            backend: Backend::Cuda,
            daemon_version: "0.1.0".into(),
        },
        Message::OpenStream(spec),
        Message::OpenStream(extended),
        Message::StreamOpened(layout),
        Message::StreamOpened(variable_layout),
        Message::EndOfEpoch { epoch: 2, steps: 3 },
        Message::Error {
            code: ErrorCode::CorruptData,
            message: "block 3".into(),
        },
        Message::Close,
        Message::StatusRequest,
        Message::Status(DaemonStatus::default()),
    ];
    messages.iter().map(|m| m.encode()[4..].to_vec()).collect()
}

proptest! {
    #[test]
    fn random_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..2048)) {
        Message::check_decode(&body);
    }

    #[test]
    fn random_payloads_of_every_kind_never_panic(
        kind in 0u16..16,
        payload in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut body = PROTOCOL_VERSION.to_le_bytes().to_vec();
        body.extend_from_slice(&kind.to_le_bytes());
        body.extend_from_slice(&payload);
        Message::check_decode(&body);
    }

    #[test]
    fn mutated_valid_frames_never_panic(
        which in any::<proptest::sample::Index>(),
        flips in proptest::collection::vec((any::<proptest::sample::Index>(), 0u8..8), 0..6),
        cut in any::<proptest::sample::Index>(),
        tail in proptest::collection::vec(any::<u8>(), 0..16),
        mode in 0u8..4,
    ) {
        let bodies = valid_bodies();
        let mut body = bodies[which.index(bodies.len())].clone();
        Message::check_decode(&body);
        for (at, bit) in &flips {
            let i = at.index(body.len());
            body[i] ^= 1 << bit;
        }
        match mode {
            0 => {}
            1 => body.truncate(cut.index(body.len() + 1)),
            2 => body.extend_from_slice(&tail),
            _ => {
                let other = &bodies[cut.index(bodies.len())];
                let keep = cut.index(body.len() + 1);
                body.truncate(keep);
                body.extend_from_slice(&other[other.len().min(4)..]);
            }
        }
        Message::check_decode(&body);
    }
}
