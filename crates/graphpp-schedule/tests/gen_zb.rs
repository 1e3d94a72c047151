//! ZB-H1, ZB-H2 and ZB auto: completeness, in-flight / memory bounds and the docs/ARCHITECTURE.md figures,
//! checked on the generated programs with the test-side replay in `common`.

mod common;

use common::{assert_complete, in_flight_peaks, memory_peaks, replay, Unit, UNIT};
use graphpp_schedule::{generate, Action, ComputeKind, GenerateError, Kind, Options, Schedule, Shape};
use proptest::prelude::*;

fn gen(kind: Kind, p: usize, m: usize) -> Schedule {
    generate(kind, &Shape::new(p, 1, m), &Options::default()).unwrap()
}

/// 1F1B built from docs/ARCHITECTURE.md's rule (w = min(m, p−1−r) warm-up F, (F, B) pairs, w B's): the baseline
/// for the ZB-H1 figure.
fn one_f_one_b(p: usize, m: usize) -> Schedule {
    Schedule::from_programs(
        (0..p)
            .map(|r| {
                let w = (p - 1 - r).min(m);
                let mut prog: Vec<Action> = (0..w).map(|j| Action::f(r, j)).collect();
                for j in 0..m - w {
                    prog.push(Action::f(r, j + w));
                    prog.push(Action::b(r, j));
                }
                prog.extend((m - w..m).map(|j| Action::b(r, j)));
                prog
            })
            .collect(),
    )
}

#[test]
fn zb_h1_idles_3_per_rank_vs_9_for_1f1b() {
    // docs/ARCHITECTURE.md: p=4, m=8, T_F=T_I=T_W=1: ZB-H1 idle 3 per rank, 1F1B 9 (24 units of work each).
    let zb = replay(&gen(Kind::ZbH1, 4, 8), UNIT).unwrap();
    let base = replay(&one_f_one_b(4, 8), UNIT).unwrap();
    for r in 0..4 {
        assert_eq!(zb.busy[r], 24.0);
        assert_eq!(base.busy[r], 24.0);
        assert_eq!(zb.idle(r), 3.0, "ZB-H1 rank {r}");
        assert_eq!(base.idle(r), 9.0, "1F1B rank {r}");
    }
}

#[test]
fn zb_h1_bubble_matches_closed_form() {
    // (p−1)(T_F + T_I − T_W) per rank (docs/ARCHITECTURE.md), here with T_F=2, T_I=2, T_W=1 → 3(p−1).
    let u = Unit { f: 2.0, b: 3.0, i: 2.0, w: 1.0 };
    for p in [2, 4, 6] {
        let t = replay(&gen(Kind::ZbH1, p, 3 * p), u).unwrap();
        for r in 0..p {
            assert_eq!(t.idle(r), 3.0 * (p as f64 - 1.0), "p={p} rank {r}");
        }
    }
}

#[test]
fn zb_h1_stage_0_of_p4_m8() {
    // Stage 0: 1F1B warm-up of 3 F, no W held back; stage 3 holds back its first 3 W's.
    let s = gen(Kind::ZbH1, 4, 8);
    let text: Vec<String> = s.program(0).iter().take(9).map(|a| a.to_string()).collect();
    assert_eq!(text, ["0F0", "0F1", "0F2", "0F3", "0I0", "0W0", "0F4", "0I1", "0W1"]);
    let text: Vec<String> = s.program(3).iter().take(8).map(|a| a.to_string()).collect();
    assert_eq!(text, ["3F0", "3I0", "3F1", "3I1", "3F2", "3I2", "3F3", "3I3"]);
}

#[test]
fn zb_h2_zero_steady_state_bubble_at_p4_m8() {
    let t = replay(&gen(Kind::ZbH2, 4, 8), UNIT).unwrap();
    for r in 0..4 {
        assert_eq!(t.busy[r], 24.0);
        assert_eq!(t.steady_bubble(r), 0.0, "rank {r}");
    }
    // ZB-H1's rank 0 still idles inside its own span (the W's it cannot place early).
    let h1 = replay(&gen(Kind::ZbH1, 4, 8), UNIT).unwrap();
    assert_eq!(h1.steady_bubble(0), 3.0);
}

#[test]
fn zb_auto_2p_unit_costs_has_zero_steady_state_bubble() {
    for (p, m) in [(4, 8), (4, 12), (3, 6), (6, 12), (8, 16)] {
        let opts = Options { mem_cap: Some(2.0 * p as f64), ..Options::default() };
        let s = generate(Kind::ZbAuto, &Shape::new(p, 1, m), &opts).unwrap();
        let t = replay(&s, UNIT).unwrap();
        for r in 0..p {
            assert_eq!(t.steady_bubble(r), 0.0, "p={p} m={m} rank {r}\n{s}");
        }
    }
}

#[test]
fn zb_auto_1p_is_no_worse_than_zb_h1() {
    for (p, m) in [(4, 8), (4, 16), (8, 16)] {
        let s = generate(Kind::ZbAuto, &Shape::new(p, 1, m), &Options::default()).unwrap();
        let auto = replay(&s, UNIT).unwrap().makespan();
        let h1 = replay(&gen(Kind::ZbH1, p, m), UNIT).unwrap().makespan();
        assert!(auto <= h1, "p={p} m={m}: ZB-1p {auto} > ZB-H1 {h1}");
        let peaks = memory_peaks(&s, 0.5);
        assert!(peaks.iter().all(|&x| x <= p as f64), "{peaks:?}");
    }
}

#[test]
fn zb_auto_matches_the_reference_illustration() {
    // sail-sg/zero-bubble-pipeline-parallelism `auto_schedule.py` illustrates `manual_order` for
    // p = 4, m = 12 (f = F, b = I, w = W), here reproduced with unit costs, cap 2p and M_W = 0:
    //   fffffffbfbfbfbfbfbwbwbwbwbwbwbwwwwww
    //    fffffbfbfbfbfbfbfbfbwbwbwbwbwwwwwwww
    //     fffbfbfbfbfbfbfbfbfbfbwbwbwwwwwwwwww
    //      fbfbfbfbfbfbfbfbfbfbfbfbwwwwwwwwwwww
    // Stages 1–3 match. Stage 0 differs after its last F: the same function drains stage 0's W's
    // before each I once all its F's are done (`if j == 0 and f[j] == nmb`), which the
    // illustration predates.
    let mut opts = Options { mem_cap: Some(8.0), ..Options::default() };
    opts.memory.m_w = 0.0;
    let s = generate(Kind::ZbAuto, &Shape::new(4, 1, 12), &opts).unwrap();
    let letters = |r: usize| -> String {
        s.program(r)
            .iter()
            .flat_map(|a| a.computes().collect::<Vec<_>>())
            .map(|(k, _)| match k {
                ComputeKind::F => 'f',
                ComputeKind::I | ComputeKind::B => 'b',
                ComputeKind::W => 'w',
            })
            .collect()
    };
    assert_eq!(letters(1), "fffffbfbfbfbfbfbfbfbwbwbwbwbwwwwwwww");
    assert_eq!(letters(2), "fffbfbfbfbfbfbfbfbfbfbwbwbwwwwwwwwww");
    assert_eq!(letters(3), "fbfbfbfbfbfbfbfbfbfbfbfbwwwwwwwwwwww");
    // Stage 0 follows the illustration up to its last F, then drains every pending W before its
    // next I.
    let zero = letters(0);
    let last_f = zero.rfind('f').unwrap();
    assert_eq!(zero[..=last_f], "fffffffbfbfbfbfbfbwbwbwbwbwbwbwwwwww"[..=last_f]);
    let pending = zero[..last_f].matches('b').count() - zero[..last_f].matches('w').count();
    assert_eq!(zero[last_f + 1..].find('b'), Some(pending), "{zero}");
}

#[test]
fn constraint_errors_name_the_rule() {
    for kind in [Kind::ZbH1, Kind::ZbH2, Kind::ZbAuto] {
        let e = generate(kind, &Shape::new(4, 2, 8), &Options::default()).unwrap_err();
        assert!(e.to_string().contains("stages-per-rank = 1"), "{e}");
    }
    let opts = Options { mem_cap: Some(0.5), ..Options::default() };
    let e = generate(Kind::ZbAuto, &Shape::new(4, 1, 8), &opts).unwrap_err();
    assert!(matches!(e, GenerateError::Constraint { kind: Kind::ZbAuto, .. }));
    assert!(e.to_string().contains("at least 1 M_B"), "{e}");
    // An infinite or NaN cap is not "below 1 M_B": it is not a number of M_B units at all.
    for cap in [f64::INFINITY, f64::NAN] {
        let opts = Options { mem_cap: Some(cap), ..Options::default() };
        let e = generate(Kind::ZbAuto, &Shape::new(4, 1, 8), &opts).unwrap_err().to_string();
        assert!(e.contains("must be a finite number of M_B units") && !e.contains("at least 1"), "{e}");
    }
    let mut opts = Options::default();
    opts.costs.w = f64::NAN;
    assert!(generate(Kind::ZbAuto, &Shape::new(4, 1, 8), &opts).is_err());
    let mut opts = Options::default();
    opts.memory.m_w = 2.0;
    assert!(generate(Kind::ZbAuto, &Shape::new(4, 1, 8), &opts)
        .unwrap_err()
        .to_string()
        .contains("M_W < M_B"));
}

/// Number of W's of stage r done before each of its I's, then the W's after its last I.
fn w_lag(prog: &[Action]) -> (Vec<usize>, usize) {
    let (mut ws, mut before_i, mut after_last_i) = (0, Vec::new(), 0);
    for a in prog {
        for (k, _) in a.computes() {
            match k {
                ComputeKind::I => {
                    before_i.push(ws);
                    after_last_i = 0;
                }
                ComputeKind::W => {
                    ws += 1;
                    after_last_i += 1;
                }
                _ => {}
            }
        }
    }
    (before_i, after_last_i)
}

/// Per-rank peak of (stage, mb) pairs whose F ran and whose W (or B) has not.
fn held_peaks(s: &Schedule) -> Vec<usize> {
    (0..s.num_ranks())
        .map(|r| {
            let (mut cur, mut peak) = (0usize, 0usize);
            for a in s.program(r) {
                for (k, _) in a.computes() {
                    match k {
                        ComputeKind::F => cur += 1,
                        ComputeKind::B | ComputeKind::W => cur -= 1,
                        ComputeKind::I => {}
                    }
                    peak = peak.max(cur);
                }
            }
            peak
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn zb_h1_is_complete_defers_r_ws_and_keeps_1f1b_memory(p in 1usize..9, m in 1usize..25) {
        let s = gen(Kind::ZbH1, p, m);
        prop_assert_eq!(s.num_ranks(), p);
        assert_complete(&s, m).map_err(TestCaseError::fail)?;
        prop_assert!(replay(&s, UNIT).is_ok());
        let peaks = in_flight_peaks(&s);
        for (r, &peak) in peaks.iter().enumerate() {
            prop_assert_eq!(peak, (p - r).min(m), "rank {}", r);
            let (before_i, after) = w_lag(&s.program(r));
            let want: Vec<usize> = (0..m).map(|j| j.saturating_sub(r)).collect();
            prop_assert_eq!(before_i, want, "stage {} W lag", r);
            // At the last I, (m−1−r)⁺ W's are done; the rest follow it.
            prop_assert_eq!(after, m - (m - 1).saturating_sub(r), "stage {} W's after its last I", r);
        }
    }

    #[test]
    fn zb_h2_is_complete_and_within_2p_minus_2r_minus_1(p in 1usize..9, m in 1usize..25) {
        let s = gen(Kind::ZbH2, p, m);
        assert_complete(&s, m).map_err(TestCaseError::fail)?;
        let peaks = in_flight_peaks(&s);
        for (r, &peak) in peaks.iter().enumerate() {
            prop_assert!(peak < 2 * (p - r), "rank {} peak {} > 2(p−r)−1", r, peak);
        }
        prop_assert_eq!(peaks[0], (2 * p - 1).min(m));
        // Held = F done, W not yet (in flight or waiting for W): at most 2p−1 on every rank.
        for (r, h) in held_peaks(&s).into_iter().enumerate() {
            prop_assert!(h < 2 * p, "rank {} holds {}", r, h);
        }
        let t = replay(&s, UNIT).map_err(TestCaseError::fail)?;
        if m + 1 >= 2 * p {
            for r in 0..p {
                prop_assert_eq!(t.steady_bubble(r), 0.0, "rank {}\n{}", r, s);
            }
        }
    }

    #[test]
    fn zb_auto_is_complete_and_under_the_cap(
        p in 1usize..7, m in 1usize..17, cap_factor in 1usize..3,
        f in 1u32..4, i in 1u32..4, w in 1u32..4, c in 0u32..2,
    ) {
        let mut opts = Options { mem_cap: Some((cap_factor * p) as f64), ..Options::default() };
        opts.costs.f = f as f64;
        opts.costs.i = i as f64;
        opts.costs.w = w as f64;
        opts.costs.b = (i + w) as f64;
        opts.costs.comm = c as f64;
        let s = generate(Kind::ZbAuto, &Shape::new(p, 1, m), &opts).unwrap();
        assert_complete(&s, m).map_err(TestCaseError::fail)?;
        prop_assert!(replay(&s, UNIT).is_ok());
        for (r, peak) in memory_peaks(&s, opts.memory.m_w).into_iter().enumerate() {
            prop_assert!(peak <= (cap_factor * p) as f64 + 1e-9, "rank {} peak {}", r, peak);
        }
    }
}
