//! Variable-length fields on the GPU backend: a daemon serving `cuda:0` gathers them on the device
//! (the staged assembler: the gather kernel's pieces placed per row, a padded field's values zeroed
//! and its index tensor uploaded ahead of the gathers), and every batch equals, byte for byte and
//! shape for shape, the same stream's batch from a daemon on the CPU backend: padded and packed,
//! capped and not, in dataset order, a window shuffle and a full shuffle, LZ4 and raw fields, with
//! a conversion (f16 to f32) and samples larger than a block.
//!
//! Run on a CUDA machine: `cargo test --test gpu_variable -- --include-ignored` (the consumer is
//! this test process, which maps the daemon's device slots).

mod common;

use std::path::Path;

use common::consumers::{copy_dataset, gpufeed_bin};
use common::daemon::Daemon;
use gpufeed::input::FieldSource;
use gpufeed::pack::CodecChoice;
use gpufeed_client::consumer::Client;
use gpufeed_client::protocol::{
    BatchForm, Device, FieldRequest, Shuffle, StreamSpec, VariableRequest,
};
use gpufeed_client::DType;

const SAMPLES: usize = 3000;

/// `docs`: `tokens` (0 to 700 i32 per sample, LZ4), `pairs` (0 to 2500 f16 pairs, raw: larger
/// than a 4 KiB block), `id` (u32, the sample's index).
fn pack(root: &Path) {
    let (mut token_ends, mut tokens) = (Vec::new(), Vec::new());
    let (mut pair_ends, mut pairs) = (Vec::new(), Vec::new());
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for sample in 0..SAMPLES {
        let length = (next() % 701) as usize * usize::from(sample % 11 != 0);
        for _ in 0..length {
            tokens.extend_from_slice(&((next() % 50_000) as i32).to_le_bytes());
        }
        token_ends.push((tokens.len() / 4) as u64);
        for i in 0..(next() % 2501) as usize {
            for value in [sample as f32 + i as f32 / 8.0, -(i as f32)] {
                pairs.extend_from_slice(&half::f16::from_f32(value).to_le_bytes());
            }
        }
        pair_ends.push((pairs.len() / 4) as u64);
    }
    let ids: Vec<u8> = (0..SAMPLES as u32).flat_map(u32::to_le_bytes).collect();
    let fields = [
        FieldSource::variable(common::field("tokens", DType::I32, &[], tokens), token_ends)
            .unwrap(),
        FieldSource::variable(common::field("pairs", DType::F16, &[2], pairs), pair_ends).unwrap(),
        common::field("id", DType::U32, &[], ids),
    ];
    for (name, codec) in [
        ("docs-lz4", CodecChoice::Lz4),
        ("docs-raw", CodecChoice::Raw),
    ] {
        let mut options = common::options(name, 4096, Some(700));
        options.codec = codec;
        common::pack_fields(&root.join(name), &fields, &options);
    }
}

/// One field of a batch: name, dtype, shape, and its bytes copied to the host.
type ServedField = (String, DType, Vec<u64>, Vec<u8>);

/// Every batch of `spec`, field by field.
fn batches(socket: &Path, spec: StreamSpec) -> Vec<Vec<ServedField>> {
    let mut stream = Client::connect(socket).unwrap().open_stream(spec).unwrap();
    let mut out = Vec::new();
    for batch in stream.by_ref() {
        let batch = batch.unwrap();
        out.push(
            batch
                .fields()
                .map(|field| {
                    let mut bytes = Vec::new();
                    field.copy_to_host(&mut bytes).unwrap();
                    (
                        field.name.to_string(),
                        field.dtype,
                        field.shape.to_vec(),
                        bytes,
                    )
                })
                .collect(),
        );
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_batches_of_variable_length_fields_equal_the_cpu_backends() {
    let root = tempfile::tempdir().unwrap();
    pack(root.path());
    let cpu_root = root.path().join("cpu-root");
    for name in ["docs-lz4", "docs-raw"] {
        copy_dataset(&root.path().join(name), &cpu_root.join(name));
    }
    let start = |root: &Path, device: &str| -> Daemon {
        let socket = root.join(format!("gpufeed-{}.sock", device.replace(':', "")));
        common::daemon::start_daemon(
            &gpufeed_bin(),
            root,
            socket,
            device,
            &[],
            std::process::Stdio::inherit(),
        )
    };
    let gpu = start(root.path(), "cuda:0");
    let cpu = start(&cpu_root, "cpu");
    let shuffles = [Shuffle::None, Shuffle::Window(2), Shuffle::Full];
    let forms = [
        (BatchForm::Padded, None),
        (BatchForm::Packed, None),
        (BatchForm::Padded, Some(100)),
        (BatchForm::Packed, Some(300)),
    ];
    for dataset in ["docs-lz4", "docs-raw"] {
        for shuffle in shuffles {
            for (form, cap) in forms {
                let mut spec = StreamSpec::new(dataset, 96);
                spec.shuffle = shuffle;
                spec.seed = 5;
                spec.fields = vec![
                    FieldRequest {
                        name: "tokens".into(),
                        dtype: None,
                    },
                    FieldRequest {
                        name: "pairs".into(),
                        dtype: Some(DType::F32),
                    },
                    FieldRequest {
                        name: "id".into(),
                        dtype: None,
                    },
                ];
                spec.variable = vec![
                    VariableRequest {
                        name: "tokens".into(),
                        form,
                        cap,
                    },
                    VariableRequest {
                        name: "pairs".into(),
                        form,
                        cap,
                    },
                ];
                let expected = batches(&cpu.socket, spec.clone());
                spec.device = Device::Cuda(0);
                let served = batches(&gpu.socket, spec);
                assert_eq!(served.len(), SAMPLES / 96);
                assert_eq!(expected.len(), served.len());
                for (step, (got, want)) in served.iter().zip(&expected).enumerate() {
                    for (got, want) in got.iter().zip(want) {
                        assert!(
                            got == want,
                            "{dataset} {shuffle:?} {form:?} cap {cap:?} step {step}: field {} differs ({:?} {:?} on the GPU, {:?} {:?} on the CPU)",
                            want.0,
                            got.1,
                            got.2,
                            want.1,
                            want.2
                        );
                    }
                }
            }
        }
    }
}
