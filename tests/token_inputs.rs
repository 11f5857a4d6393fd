//! Token files as pack inputs (`gpufeed pack --tokens`, `gpufeed list-inputs`): Megatron-LM indexed
//! datasets written here byte by byte in Megatron's `.idx` layout, flat `.bin` token arrays and 1-D
//! `.npy` files, cut into `--seq-len` sequences with the remainder dropped. Every malformed index
//! (bad magic, version or dtype; wrong length; sizes, pointers or document indices that disagree
//! with the `.bin` or with each other) is refused with an error naming the index and the record at
//! fault, and nothing is packed. `tests/interop.rs` compares packed token files with NumPy's reading.

mod common;

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

use common::{assert_fails, assert_succeeds, gpufeed, read_npy, stdout};
use gpufeed::input::tokens::{cut_all, open_tokens, TokenFormat};
use gpufeed::input::FieldSource;
use gpufeed_client::DType;

/// A Megatron index's contents, written by [`Megatron::write`] in `_IndexWriter`'s layout.
#[derive(Clone)]
struct Megatron {
    code: u8,
    version: u64,
    sizes: Vec<i32>,
    pointers: Vec<i64>,
    documents: Vec<i64>,
    bin: Vec<u8>,
}

impl Megatron {
    /// Int32 token ids `0, 1, 2, ...` in sequences of `sizes`; each document is the sequences of
    /// one entry of `grouping` (how many sequences it has, possibly 0).
    fn new(sizes: &[i32], grouping: &[usize]) -> Megatron {
        let mut pointers = Vec::new();
        let mut at = 0i64;
        for &size in sizes {
            pointers.push(at);
            at += size as i64 * 4;
        }
        let mut documents = vec![0i64];
        for &count in grouping {
            documents.push(documents.last().unwrap() + count as i64);
        }
        assert_eq!(*documents.last().unwrap(), sizes.len() as i64);
        let tokens: i32 = sizes.iter().sum();
        Megatron {
            code: 4,
            version: 1,
            sizes: sizes.to_vec(),
            pointers,
            documents,
            bin: (0..tokens).flat_map(i32::to_le_bytes).collect(),
        }
    }

    fn index_bytes(&self) -> Vec<u8> {
        let mut out = b"MMIDIDX\x00\x00".to_vec();
        out.extend_from_slice(&self.version.to_le_bytes());
        out.push(self.code);
        out.extend_from_slice(&(self.sizes.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.documents.len() as u64).to_le_bytes());
        self.sizes
            .iter()
            .for_each(|s| out.extend_from_slice(&s.to_le_bytes()));
        self.pointers
            .iter()
            .for_each(|p| out.extend_from_slice(&p.to_le_bytes()));
        self.documents
            .iter()
            .for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
        out
    }

    /// Writes `PREFIX.bin` and `PREFIX.idx` under `dir`; returns the `.bin`.
    fn write(&self, dir: &Path, prefix: &str) -> PathBuf {
        self.write_index(dir, prefix, &self.index_bytes())
    }

    fn write_index(&self, dir: &Path, prefix: &str, index: &[u8]) -> PathBuf {
        let bin = dir.join(format!("{prefix}.bin"));
        fs::write(&bin, &self.bin).unwrap();
        fs::write(dir.join(format!("{prefix}.idx")), index).unwrap();
        bin
    }
}

fn all_bytes(field: &FieldSource) -> Vec<u8> {
    let mut out = Vec::new();
    field
        .copy_samples(0, field.sample_count(), &mut out)
        .unwrap();
    out
}

#[test]
fn a_megatron_dataset_cuts_into_sequences_with_doc_starts_and_drops_the_remainder() {
    let tmp = tempfile::tempdir().unwrap();
    // Documents: [5 tokens], [3 + 4 tokens], [] (empty), [6 tokens]: 18 tokens, starts at 0, 5, 12.
    let megatron = Megatron::new(&[5, 3, 4, 6], &[1, 2, 0, 1]);
    let bin = megatron.write(tmp.path(), "corpus");
    let input = open_tokens(&bin, None).unwrap();
    assert_eq!(input.dtype, DType::I32);
    assert_eq!(input.tokens, 18);
    assert_eq!(
        input.format,
        TokenFormat::Megatron {
            index: tmp.path().join("corpus.idx"),
            sequences: 4,
            documents: 4
        }
    );
    let cut = input.cut(4).unwrap();
    assert_eq!((cut.sequences, cut.dropped_tokens), (4, 2));
    assert_eq!(cut.fields.len(), 2);
    let tokens = &cut.fields[0];
    assert_eq!((tokens.name.as_str(), tokens.dtype), ("tokens", DType::I32));
    assert_eq!(tokens.sample_shape, vec![4]);
    let expected: Vec<u8> = (0..16i32).flat_map(i32::to_le_bytes).collect();
    assert_eq!(all_bytes(tokens), expected);
    let starts = &cut.fields[1];
    assert_eq!(
        (starts.name.as_str(), starts.dtype),
        ("doc_start", DType::U8)
    );
    let mut expected = vec![0u8; 16];
    for at in [0, 5, 12] {
        expected[at] = 1;
    }
    assert_eq!(all_bytes(starts), expected);
    // A range starting mid-stream finds its starts too (the packer copies block by block).
    let mut part = Vec::new();
    starts.copy_samples(1, 2, &mut part).unwrap();
    assert_eq!(part, expected[4..12]);
    // The same input named by its index.
    let by_index = open_tokens(&tmp.path().join("corpus.idx"), None).unwrap();
    assert_eq!(by_index.tokens, 18);
}

#[test]
fn pack_and_list_inputs_take_a_megatron_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let megatron = Megatron::new(&[5, 3, 4, 6], &[1, 2, 0, 1]);
    let bin = megatron.write(tmp.path(), "corpus");
    let listing = assert_succeeds(&gpufeed([
        OsString::from("list-inputs"),
        tmp.path().join("corpus.idx").into(),
        "--seq-len".into(),
        "4".into(),
    ]));
    assert!(listing.contains("Megatron-LM indexed dataset"), "{listing}");
    assert!(
        listing.contains("18 i32 tokens in 4 sequences, 4 documents"),
        "{listing}"
    );
    assert!(
        listing.contains("4 sequences, 2 remainder tokens dropped"),
        "{listing}"
    );

    let out = tmp.path().join("ds");
    let output = gpufeed([
        OsString::from("pack"),
        "--quiet".into(),
        "--out".into(),
        out.clone().into(),
        "--tokens".into(),
        bin.into(),
        "--seq-len".into(),
        "4".into(),
    ]);
    assert_succeeds(&output);
    let text = common::stderr(&output);
    assert!(
        text.contains(
            "18 tokens from 1 file(s) cut into 4 sequences of 4; 2 remainder tokens dropped"
        ),
        "{text}"
    );
    let unpacked = tmp.path().join("t.npy");
    assert_succeeds(&gpufeed([
        OsString::from("unpack"),
        out.into(),
        "--field".into(),
        "tokens".into(),
        "--out".into(),
        unpacked.clone().into(),
        "--quiet".into(),
    ]));
    let npy = read_npy(&unpacked);
    assert_eq!(npy.shape, vec![4, 4]);
    assert_eq!(
        npy.bytes,
        (0..16i32).flat_map(i32::to_le_bytes).collect::<Vec<u8>>()
    );
}

#[test]
fn flat_bins_and_npy_files_cut_into_sequences() {
    let tmp = tempfile::tempdir().unwrap();
    let flat = tmp.path().join("flat.bin");
    let ids: Vec<u8> = (0..1000u16).flat_map(u16::to_le_bytes).collect();
    fs::write(&flat, &ids).unwrap();
    let input = open_tokens(&flat, Some(DType::U16)).unwrap();
    assert_eq!(
        (input.format.clone(), input.tokens),
        (TokenFormat::Flat, 1000)
    );
    let cut = input.cut(64).unwrap();
    assert_eq!((cut.sequences, cut.dropped_tokens), (15, 40));
    assert_eq!(
        cut.fields.len(),
        1,
        "a flat file has no document boundaries"
    );
    assert_eq!(all_bytes(&cut.fields[0]), ids[..15 * 64 * 2]);

    // Without a dtype a flat .bin is refused, naming the file and the flag.
    let error = open_tokens(&flat, None).unwrap_err().to_string();
    assert!(
        error.contains("flat.bin") && error.contains("--token-dtype"),
        "{error}"
    );
    // An odd length is not a whole number of u32 tokens.
    fs::write(&flat, &ids[..6]).unwrap();
    let error = open_tokens(&flat, Some(DType::U32))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("not a whole number of u32 tokens"),
        "{error}"
    );

    let npy = tmp.path().join("tokens.npy");
    let data: Vec<u8> = (0..300i64).flat_map(i64::to_le_bytes).collect();
    common::write_npy(&npy, DType::I64, &[300], &data);
    let input = open_tokens(&npy, None).unwrap();
    assert_eq!(
        (input.format.clone(), input.dtype),
        (TokenFormat::Npy, DType::I64)
    );
    let cut = input.cut(100).unwrap();
    assert_eq!((cut.sequences, cut.dropped_tokens), (3, 0));
    assert_eq!(all_bytes(&cut.fields[0]), data);
    // Fewer tokens than one sequence.
    let error = input.cut(301).unwrap_err().to_string();
    assert!(
        error.contains("fewer than one sequence of --seq-len 301"),
        "{error}"
    );

    let two_d = tmp.path().join("rows.npy");
    common::write_npy(&two_d, DType::I32, &[3, 4], &[0u8; 48]);
    let error = open_tokens(&two_d, None).unwrap_err().to_string();
    assert!(
        error.contains("rows.npy") && error.contains("must be 1-D"),
        "{error}"
    );
    let floats = tmp.path().join("floats.npy");
    common::write_npy(&floats, DType::F32, &[4], &[0u8; 16]);
    let error = open_tokens(&floats, None).unwrap_err().to_string();
    assert!(error.contains("not an integer type"), "{error}");
}

/// One malformed index: how to break it, and what the error must say besides the index's path.
struct Broken {
    what: &'static str,
    index: Vec<u8>,
    bin: Option<Vec<u8>>,
    says: &'static [&'static str],
}

#[test]
fn malformed_megatron_indexes_are_refused_naming_the_index_and_record() {
    let good = Megatron::new(&[5, 3, 4, 6], &[1, 2, 0, 1]);
    let with = |change: &dyn Fn(&mut Megatron)| {
        let mut m = good.clone();
        change(&mut m);
        m.index_bytes()
    };
    let mut cases = vec![
        Broken {
            what: "bad magic",
            index: {
                let mut b = good.index_bytes();
                b[0] = b'X';
                b
            },
            bin: None,
            says: &["magic MMIDIDX"],
        },
        Broken {
            what: "version 2",
            index: with(&|m| m.version = 2),
            bin: None,
            says: &["version 2"],
        },
        Broken {
            what: "float dtype",
            index: with(&|m| m.code = 7),
            bin: None,
            says: &["dtype code 7 (float32)"],
        },
        Broken {
            what: "unknown dtype",
            index: with(&|m| m.code = 9),
            bin: None,
            says: &["unknown dtype code 9"],
        },
        Broken {
            what: "truncated index",
            index: {
                let b = good.index_bytes();
                b[..b.len() - 3].to_vec()
            },
            bin: None,
            says: &["truncated"],
        },
        Broken {
            what: "short header",
            index: good.index_bytes()[..20].to_vec(),
            bin: None,
            says: &["fewer than the 34-byte header"],
        },
        Broken {
            what: "trailing bytes",
            index: {
                let mut b = good.index_bytes();
                b.extend_from_slice(&[0; 3]);
                b
            },
            bin: None,
            says: &["3 trailing bytes"],
        },
        Broken {
            what: "multimodal modes",
            index: {
                let mut b = good.index_bytes();
                b.extend_from_slice(&[0; 4]);
                b
            },
            bin: None,
            says: &["multimodal"],
        },
        Broken {
            what: "sizes past the .bin",
            index: with(&|m| m.sizes[3] = 7),
            bin: None,
            says: &["sequence 3", "past the 72 bytes of"],
        },
        Broken {
            what: "negative size",
            index: with(&|m| m.sizes[1] = -1),
            bin: None,
            says: &["sequence 1: negative size -1"],
        },
        Broken {
            what: "pointer not increasing",
            index: with(&|m| m.pointers[2] = m.pointers[1]),
            bin: None,
            says: &["sequence 2: pointer 20 does not increase"],
        },
        Broken {
            what: "pointer gap",
            index: with(&|m| m.pointers[2] += 4),
            bin: None,
            says: &["sequence 2", "gap"],
        },
        Broken {
            what: "first pointer not 0",
            index: with(&|m| m.pointers[0] = 4),
            bin: None,
            says: &["sequence 0: pointer 4"],
        },
        Broken {
            what: ".bin longer than the sizes",
            index: good.index_bytes(),
            bin: Some({
                let mut b = good.bin.clone();
                b.extend_from_slice(&[0; 8]);
                b
            }),
            says: &["sum to 72 bytes", "has 80"],
        },
        Broken {
            what: "first document index not 0",
            index: with(&|m| m.documents[0] = 1),
            bin: None,
            says: &["document index 0 is 1"],
        },
        Broken {
            what: "decreasing document indices",
            index: with(&|m| m.documents[2] = 0),
            bin: None,
            says: &["document index 2 is 0, less than document index 1"],
        },
        Broken {
            what: "document index past the sequences",
            index: with(&|m| m.documents[3] = 9),
            bin: None,
            says: &["document index 3 is 9, past the 4 sequences"],
        },
        Broken {
            what: "last document index short",
            index: with(&|m| m.documents[4] = 3),
            bin: None,
            says: &["last document index (4) is 3"],
        },
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (n, case) in cases.drain(..).enumerate() {
        let prefix = format!("broken{n}");
        let mut megatron = good.clone();
        if let Some(bin) = case.bin {
            megatron.bin = bin;
        }
        let bin = megatron.write_index(tmp.path(), &prefix, &case.index);
        let index = tmp.path().join(format!("{prefix}.idx"));
        let error = open_tokens(&bin, None).unwrap_err().to_string();
        assert!(
            error.starts_with(&index.display().to_string()),
            "{}: the error should name {}: {error}",
            case.what,
            index.display()
        );
        for needle in case.says {
            assert!(
                error.contains(needle),
                "{}: {error} lacks {needle:?}",
                case.what
            );
        }
        // The CLI refuses it the same way and packs nothing.
        let out = tmp.path().join(format!("out{n}"));
        let output = gpufeed([
            OsString::from("pack"),
            "--quiet".into(),
            "--out".into(),
            out.clone().into(),
            "--tokens".into(),
            bin.into(),
            "--seq-len".into(),
            "4".into(),
        ]);
        let stderr = assert_fails(&output);
        assert!(stderr.contains(&error), "{}: {stderr}", case.what);
        assert!(!out.exists(), "{}: a dataset was written", case.what);
        let listed = gpufeed([OsString::from("list-inputs"), index.into()]);
        assert!(
            !listed.status.success(),
            "{}: {}",
            case.what,
            stdout(&listed)
        );
    }
}

#[test]
fn several_token_files_pack_as_one_dataset_each_cut_on_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    // 18 tokens (starts 0, 5, 12) and 9 tokens (starts 0, 2): at --seq-len 4, 4 + 2 sequences,
    // 2 + 1 tokens dropped, and no sequence spans the two files.
    let a = Megatron::new(&[5, 3, 4, 6], &[1, 2, 0, 1]);
    let b = Megatron::new(&[2, 7], &[1, 1]);
    let inputs = [
        open_tokens(&a.write(tmp.path(), "a"), None).unwrap(),
        open_tokens(&b.write(tmp.path(), "b"), None).unwrap(),
    ];
    let cut = cut_all(&inputs, 4).unwrap();
    assert_eq!((cut.sequences, cut.dropped_tokens), (6, 3));
    let tokens: Vec<u8> = (0..16i32).chain(0..8).flat_map(i32::to_le_bytes).collect();
    assert_eq!(all_bytes(&cut.fields[0]), tokens);
    let mut starts = vec![0u8; 24];
    for at in [0, 5, 12, 16, 18] {
        starts[at] = 1;
    }
    assert_eq!(all_bytes(&cut.fields[1]), starts);

    // A flat file has no document boundaries to pack beside a Megatron dataset's.
    let flat = tmp.path().join("flat.bin");
    fs::write(&flat, [0u8; 64]).unwrap();
    let mixed = [
        open_tokens(&tmp.path().join("a.bin"), None).unwrap(),
        open_tokens(&flat, Some(DType::I32)).unwrap(),
    ];
    let error = cut_all(&mixed, 4).unwrap_err().to_string();
    assert!(
        error.contains("flat.bin") && error.contains("document boundaries"),
        "{error}"
    );
    let other_dtype = [
        open_tokens(&tmp.path().join("a.bin"), None).unwrap(),
        open_tokens(&flat, Some(DType::U16)).unwrap(),
    ];
    let error = cut_all(&other_dtype, 4).unwrap_err().to_string();
    assert!(
        error.contains("flat.bin") && error.contains("dtype u16"),
        "{error}"
    );
}
