//! DualPipe and DualPipeV: routes, completeness, placement, in-flight bounds, the docs/ARCHITECTURE.md bubble
//! (p/2−1)(T_{F&B} + T_B − 3T_W) and the shape constraints.

mod common;

use common::{assert_complete, in_flight_peaks, replay, UNIT};
use graphpp_schedule::{
    generate, Action, ComputeKind, GenerateError, Kind, Options, Placement, Schedule, Shape,
};
use proptest::prelude::*;

fn gen(kind: Kind, p: usize, m: usize) -> Schedule {
    generate(kind, &Shape::new(p, 2, m), &Options::default()).unwrap()
}

fn assert_v_placement(s: &Schedule, p: usize) {
    for (stage, ranks) in s.placement() {
        assert_eq!(ranks, vec![Placement::V.rank_of(stage, p)], "stage {stage}");
    }
}

#[test]
fn dualpipe_bubble_is_p_minus_2_with_unit_costs() {
    // (p/2−1)(T_{F&B} + T_B − 3T_W) with T_F = T_I = T_W = 1, T_B = 2, T_{F&B} = T_F + T_B = 3:
    // (p/2−1)·2 = p − 2 idle per rank (tutorial seed, "DualPipe · 账本").
    for (p, m) in [(4, 8), (4, 20), (8, 16), (8, 20), (6, 14)] {
        let t = replay(&gen(Kind::DualPipe, p, m), UNIT).unwrap();
        for r in 0..p {
            assert_eq!(t.busy[r], 3.0 * m as f64, "p={p} m={m} rank {r}");
            assert_eq!(t.idle(r), p as f64 - 2.0, "p={p} m={m} rank {r}");
        }
    }
}

#[test]
fn dualpipev_bubble_is_dualpipe_with_2p_stages() {
    // docs/ARCHITECTURE.md: "as DualPipe with p ↦ 2p stages": (p−1)·2 = 2p − 2 idle per rank.
    for (p, m) in [(2, 4), (4, 8), (4, 10), (4, 20), (8, 16)] {
        let t = replay(&gen(Kind::DualPipeV, p, m), UNIT).unwrap();
        for r in 0..p {
            assert_eq!(t.busy[r], 6.0 * m as f64, "p={p} m={m} rank {r}");
            assert_eq!(t.idle(r), 2.0 * p as f64 - 2.0, "p={p} m={m} rank {r}");
        }
    }
}

#[test]
fn dualpipe_middle_ranks_start_phase_4_unoverlapped() {
    // p=4, m=8: h=2; middle ranks 1 and 2 (r = 1 = h−1) run their first phase-4 pair as F_A, B_D.
    let s = gen(Kind::DualPipe, 4, 8);
    let text = |r: usize| s.program(r).iter().map(|a| a.to_string()).collect::<Vec<_>>();
    // Rank 1: A = down stage 1 (mbs 0..4), D = up stage 6 (mbs 4..8).
    assert_eq!(text(1)[..6], ["1F0", "6F4", "1F1", "6F5", "1F2", "6B4"]);
    // Rank 3 (second half): A = up stage 4, D = down stage 3; phase 1 = 2 F_A.
    assert_eq!(text(3)[..4], ["4F4", "4F5", "4F6", "3F0"]);
    assert!(text(0).iter().any(|a| a.ends_with("OVERLAP_F_B")));
}

#[test]
fn constraint_errors_name_the_rule() {
    let err =
        |kind, p, v, m| generate(kind, &Shape::new(p, v, m), &Options::default()).unwrap_err().to_string();
    assert!(err(Kind::DualPipe, 3, 2, 12).contains("even number of ranks"));
    assert!(err(Kind::DualPipe, 4, 2, 9).contains("even number of microbatches"));
    assert!(err(Kind::DualPipe, 4, 2, 6).contains("needs m >= 2p (m=6, 2p=8)"));
    assert!(err(Kind::DualPipe, 4, 1, 8).contains("stages-per-rank = 2"));
    assert!(err(Kind::DualPipeV, 4, 2, 7).contains("needs m >= 2p (m=7, 2p=8)"));
    assert!(err(Kind::DualPipeV, 4, 3, 8).contains("stages-per-rank = 2"));
    let e = generate(Kind::DualPipeV, &Shape::new(4, 2, 7), &Options::default()).unwrap_err();
    assert!(matches!(e, GenerateError::Constraint { kind: Kind::DualPipeV, microbatches: 7, .. }));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn dualpipe_routes_are_the_two_directions(half_p in 1usize..5, extra in 0usize..6) {
        let p = 2 * half_p;
        let m = 2 * p + 2 * extra;
        let s = gen(Kind::DualPipe, p, m);
        prop_assert_eq!(s.num_ranks(), p);
        for mb in 0..m {
            let want = if mb < m / 2 { 0..p } else { p..2 * p };
            prop_assert_eq!(s.route(mb), Some(want), "microbatch {}", mb);
        }
        assert_complete(&s, m).map_err(TestCaseError::fail)?;
        assert_v_placement(&s, p);
        let peaks = in_flight_peaks(&s);
        prop_assert!(peaks.iter().all(|&x| x <= p + 1), "{:?}", peaks);
        prop_assert_eq!(peaks.iter().max(), Some(&(p + 1)));
        replay(&s, UNIT).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn dualpipev_is_complete_over_2p_stages(p in 1usize..8, extra in 0usize..8) {
        let m = 2 * p + extra;
        let s = gen(Kind::DualPipeV, p, m);
        for mb in 0..m {
            prop_assert_eq!(s.route(mb), Some(0..2 * p));
        }
        assert_complete(&s, m).map_err(TestCaseError::fail)?;
        assert_v_placement(&s, p);
        let peaks = in_flight_peaks(&s);
        prop_assert!(peaks.iter().all(|&x| x <= 2 * p + 1), "{:?}", peaks);
        // Every rank ends with W's only (phase 8) and OVERLAP_F_B pairs an F of one chunk with a B
        // of the other.
        for r in 0..p {
            let prog = s.program(r);
            let last_is_w = matches!(prog.last(), Some(Action::Compute { kind: ComputeKind::W, .. }));
            prop_assert!(last_is_w, "rank {} ends with {:?}", r, prog.last());
            for a in &prog {
                if let Action::Overlap { f, b } = a {
                    prop_assert_ne!(f.stage, b.stage);
                }
            }
        }
        replay(&s, UNIT).map_err(TestCaseError::fail)?;
    }
}
