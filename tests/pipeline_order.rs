//! The sample-order rules of `pipeline::order`, as properties: an epoch's order is a permutation that
//! depends only on (shard layout, seed, epoch, mode); ranks are disjoint, cover the epoch and get equal
//! step counts; resuming at a cursor equals the tail of an uninterrupted run, also at another world
//! size and batch size (elastic resume); padding and dropping behave as documented.

use std::collections::HashSet;

use gpufeed::pipeline::{EpochOrder, RankPlan, ShuffleMode, Tail};
use proptest::prelude::*;

fn mode_strategy() -> impl Strategy<Value = ShuffleMode> {
    prop_oneof![
        Just(ShuffleMode::None),
        Just(ShuffleMode::Full),
        (1u32..4).prop_map(|shards| ShuffleMode::Window { shards }),
    ]
}

fn shards_strategy() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(1u64..200, 1..8)
}

/// Every sample a whole world serves from `cursor` to the end of the epoch, in global-order positions.
fn world_positions(plan: RankPlan, n: u64, cursor: u64) -> Vec<Vec<u64>> {
    let steps = plan.steps_from(n, cursor);
    (0..plan.world_size)
        .map(|rank| {
            let plan = RankPlan { rank, ..plan };
            (0..steps)
                .flat_map(|step| plan.batch_positions(n, cursor, step).collect::<Vec<_>>())
                .collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn order_is_a_deterministic_permutation(shards in shards_strategy(), seed: u64, epoch in 0u64..5, mode in mode_strategy()) {
        let order = EpochOrder::new(&shards, seed, epoch, mode);
        let n: u64 = shards.iter().sum();
        let samples: Vec<u64> = (0..n).map(|p| order.sample_at(p)).collect();
        let unique: HashSet<u64> = samples.iter().copied().collect();
        prop_assert_eq!(unique.len() as u64, n);
        prop_assert!(samples.iter().all(|&s| s < n));
        let again = EpochOrder::new(&shards, seed, epoch, mode);
        prop_assert!((0..n).all(|p| again.sample_at(p) == samples[p as usize]));
    }

    #[test]
    fn ranks_are_disjoint_cover_the_epoch_and_take_equal_steps(
        shards in shards_strategy(), seed: u64, mode in mode_strategy(),
        world in 1u32..6, batch in 1u32..20, pad: bool,
    ) {
        let n: u64 = shards.iter().sum();
        let tail = if pad { Tail::Pad } else { Tail::Drop };
        let plan = RankPlan { world_size: world, rank: 0, batch_size: batch, tail };
        let order = EpochOrder::new(&shards, seed, 0, mode);
        let per_rank = world_positions(plan, n, 0);
        let lengths: HashSet<usize> = per_rank.iter().map(Vec::len).collect();
        prop_assert_eq!(lengths.len(), 1, "every rank serves the same number of samples");
        let all: Vec<u64> = per_rank.iter().flatten().map(|&p| order.sample_at(p)).collect();
        let unique: HashSet<u64> = all.iter().copied().collect();
        let step = world as u64 * batch as u64;
        match tail {
            Tail::Drop => {
                prop_assert_eq!(unique.len(), all.len(), "no sample twice when dropping");
                prop_assert_eq!(all.len() as u64, n / step * step);
            }
            Tail::Pad => {
                prop_assert_eq!(unique.len() as u64, n, "padding covers every sample");
                prop_assert_eq!(all.len() as u64, n.div_ceil(step) * step);
            }
        }
    }

    #[test]
    fn resume_at_a_step_equals_the_tail_of_an_uninterrupted_run(
        shards in shards_strategy(),
        world in 1u32..5, batch in 1u32..16, resume_step in 0u64..10,
    ) {
        let n: u64 = shards.iter().sum();
        let plan = RankPlan { world_size: world, rank: 0, batch_size: batch, tail: Tail::Drop };
        let steps = plan.steps_from(n, 0);
        let resume_step = resume_step.min(steps);
        let cursor = resume_step * plan.step_samples();
        for rank in 0..world {
            let plan = RankPlan { rank, ..plan };
            for step in resume_step..steps {
                let uninterrupted: Vec<u64> = plan.batch_positions(n, 0, step).collect();
                let resumed: Vec<u64> = plan.batch_positions(n, cursor, step - resume_step).collect();
                prop_assert_eq!(uninterrupted, resumed);
            }
            prop_assert_eq!(plan.steps_from(n, cursor), steps - resume_step);
        }
    }

    #[test]
    fn elastic_resume_neither_repeats_nor_skips_within_the_epoch(
        shards in shards_strategy(), seed: u64, mode in mode_strategy(),
        world in 1u32..5, batch in 1u32..16, new_world in 1u32..5, new_batch in 1u32..16,
        checkpoint_step in 0u64..6,
    ) {
        let n: u64 = shards.iter().sum();
        let order = EpochOrder::new(&shards, seed, 3, mode);
        let before = RankPlan { world_size: world, rank: 0, batch_size: batch, tail: Tail::Drop };
        let checkpoint_step = checkpoint_step.min(before.steps_from(n, 0));
        let cursor = checkpoint_step * before.step_samples();
        let mut served: Vec<u64> = Vec::new();
        for rank in 0..world {
            let plan = RankPlan { rank, ..before };
            for step in 0..checkpoint_step {
                served.extend(plan.batch_positions(n, 0, step).map(|p| order.sample_at(p)));
            }
        }
        let after = RankPlan { world_size: new_world, rank: 0, batch_size: new_batch, tail: Tail::Drop };
        for positions in world_positions(after, n, cursor) {
            served.extend(positions.into_iter().map(|p| order.sample_at(p)));
        }
        let unique: HashSet<u64> = served.iter().copied().collect();
        prop_assert_eq!(unique.len(), served.len(), "a sample was served twice");
        let left = n - cursor;
        let expected = cursor + left / after.step_samples() * after.step_samples();
        prop_assert_eq!(served.len() as u64, expected, "only the final partial step may be left out");
    }
}

#[test]
fn different_epochs_and_seeds_give_different_orders() {
    let shards = [1000u64, 1000, 1000];
    let order = |seed, epoch, mode| {
        let o = EpochOrder::new(&shards, seed, epoch, mode);
        (0..o.len()).map(|p| o.sample_at(p)).collect::<Vec<_>>()
    };
    for mode in [ShuffleMode::Full, ShuffleMode::Window { shards: 2 }] {
        assert_ne!(order(1, 0, mode), order(1, 1, mode));
        assert_ne!(order(1, 0, mode), order(2, 0, mode));
        // A shuffle that leaves most samples in place would be useless for training.
        let shuffled = order(1, 0, mode);
        let fixed = shuffled
            .iter()
            .enumerate()
            .filter(|(p, &s)| *p as u64 == s)
            .count();
        assert!(fixed < 30, "{fixed} fixed points out of 3000 in {mode:?}");
    }
    assert_eq!(
        order(1, 0, ShuffleMode::None),
        (0..3000).collect::<Vec<_>>()
    );
}

#[test]
fn window_shuffle_keeps_reads_within_a_window_of_shards() {
    let shards = [500u64; 8];
    let order = EpochOrder::new(&shards, 9, 0, ShuffleMode::Window { shards: 2 });
    // Each run of 1000 positions (one window of two 500-sample shards) draws on exactly two shards.
    for window in 0..4 {
        let touched: HashSet<u64> = (window * 1000..(window + 1) * 1000)
            .map(|p| order.sample_at(p) / 500)
            .collect();
        assert_eq!(touched.len(), 2, "window {window} touched {touched:?}");
    }
}
