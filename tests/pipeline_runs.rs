//! Runs of rows (`StreamPlan::placement_runs`, used by the GPU assembler) against the per-row
//! placements (`StreamPlan::placements`, the CPU assembler's): every row of a run has exactly the range
//! the per-row placement gives it, the run's blocks are exactly the blocks its rows need, and the
//! runs cover the batch's rows in order, whatever the shuffle, rank and run bound.

mod common;

use std::sync::Arc;

use gpufeed::format::Dataset;
use gpufeed::pipeline::{StreamLimits, StreamPlan, StreamRequest};
use gpufeed_client::protocol::{FieldRequest, Shuffle, StreamSpec};
use gpufeed_client::DType;

#[test]
fn runs_agree_with_per_row_placements() {
    let dir = tempfile::tempdir().unwrap();
    let samples = 1000usize;
    // Odd sample sizes and small blocks, so samples straddle block boundaries; several shards, so
    // runs must break where a shard ends.
    let fields = vec![
        common::field("a", DType::F16, &[37], common::noise(samples * 37 * 2, 1)),
        common::field(
            "b",
            DType::I32,
            &[5],
            common::i32_bytes(samples * 5, |i| (i % 97) as i32),
        ),
    ];
    let out = dir.path().join("runs");
    common::pack_fields(&out, &fields, &common::options("runs", 4096, Some(300)));
    let dataset = Arc::new(Dataset::open(&out).unwrap());
    for shuffle in [Shuffle::None, Shuffle::Full, Shuffle::Window(2)] {
        for (rank, world) in [(0, 1), (1, 3)] {
            let mut spec = StreamSpec::new("runs".to_string(), 64);
            spec.fields = vec![
                FieldRequest {
                    name: "a".into(),
                    dtype: Some(DType::F32),
                },
                FieldRequest {
                    name: "b".into(),
                    dtype: None,
                },
            ];
            spec.shuffle = shuffle;
            spec.seed = 7;
            spec.rank = rank;
            spec.world_size = world;
            let plan = StreamPlan::new(
                Arc::clone(&dataset),
                &StreamRequest::from(&spec),
                &StreamLimits::node_defaults(),
            )
            .unwrap();
            let field_count = plan.fields.len();
            for run_bytes in [1usize, 1000, 1 << 20] {
                for step in 0..plan.steps {
                    let rows = plan.placements(step);
                    let runs = plan.placement_runs(step, run_bytes);
                    assert_eq!(runs.placements.len(), runs.runs.len() * field_count);
                    let mut next_row = 0usize;
                    for (run, &(first, count)) in runs.runs.iter().enumerate() {
                        assert_eq!(first, next_row, "runs cover the rows in order");
                        assert!(count >= 1);
                        let widest = plan
                            .fields
                            .iter()
                            .map(|f| f.sample_bytes_out)
                            .max()
                            .unwrap();
                        assert!(count == 1 || count * widest <= run_bytes);
                        next_row += count;
                        for (f, field) in plan.fields.iter().enumerate() {
                            let whole = &runs.placements[run * field_count + f];
                            let width = field.sample_bytes_in as u64;
                            let (mut first_block, mut end_block) = (u32::MAX, 0u32);
                            for i in 0..count {
                                let row = &rows[(first + i) * field_count + f];
                                assert_eq!(row.shard, whole.shard);
                                assert_eq!(row.start, whole.start + i as u64 * width);
                                assert_eq!(row.end, row.start + width);
                                first_block = first_block.min(row.blocks.start);
                                end_block = end_block.max(row.blocks.end);
                            }
                            assert_eq!(whole.end, whole.start + count as u64 * width);
                            assert_eq!(
                                whole.blocks,
                                first_block..end_block,
                                "{shuffle:?} rank {rank} step {step} run {run} field {f}"
                            );
                        }
                    }
                    assert_eq!(next_row * field_count, rows.len());
                }
            }
        }
    }
}
