//! Llama-3 grouped interleaving: completeness, Megatron equivalence at N = p, breadth-first forwards
//! at N = m, in-flight peaks growing with N, the interleaved bubble, and the constraints.

mod common;

use common::{assert_complete, in_flight_peaks, replay, UNIT};
use graphpp_schedule::{generate, ComputeKind, Kind, Options, Schedule, Shape};
use proptest::prelude::*;

fn gen(p: usize, v: usize, m: usize, n: usize) -> Schedule {
    let opts = Options { group: Some(n), ..Options::default() };
    generate(Kind::GroupedInterleaved, &Shape::new(p, v, m), &opts).unwrap()
}

fn text(s: &Schedule, r: usize) -> Vec<String> {
    s.program(r).iter().map(|a| a.to_string()).collect()
}

#[test]
fn n_equal_p_is_megatron_depth_first() {
    // p=4, v=2, m=8: rank 0 warms up with (v−1)p + 2(p−1) = 10 F's — mbs 0..4 on stage 0, 0..4 on
    // stage 4, 4..6 on stage 0 — then F(0, 6), then the first backward, chunk 1 (stage 4), mb 0.
    let s = gen(4, 2, 8, 4);
    let t = text(&s, 0);
    assert_eq!(t[..12], ["0F0", "0F1", "0F2", "0F3", "4F0", "4F1", "4F2", "4F3", "0F4", "0F5", "0F6", "4B0"]);
    // Default group is p.
    let d = generate(Kind::GroupedInterleaved, &Shape::new(4, 2, 8), &Options::default()).unwrap();
    assert_eq!(d, s);
    // docs/ARCHITECTURE.md: stage-0 peak p + (p−1)/v = 5.5 full-stage units = 11 chunk units.
    assert_eq!(in_flight_peaks(&s)[0], 11);
}

#[test]
fn n_equal_m_runs_forwards_breadth_first() {
    let (p, v, m) = (4, 3, 8);
    let s = gen(p, v, m, m);
    for r in 0..p {
        let fwd_stages: Vec<usize> = s
            .program(r)
            .iter()
            .flat_map(|a| a.computes().collect::<Vec<_>>())
            .filter(|(k, _)| *k == ComputeKind::F)
            .map(|(_, t)| t.stage)
            .collect();
        let mut sorted = fwd_stages.clone();
        sorted.sort();
        assert_eq!(fwd_stages, sorted, "rank {r}: a chunk's F's all come before the next chunk's");
    }
}

#[test]
fn peak_in_flight_grows_with_n() {
    let peaks: Vec<usize> = [4, 8, 16].iter().map(|&n| in_flight_peaks(&gen(4, 2, 16, n))[0]).collect();
    assert_eq!(peaks, [11, 15, 23]);
}

#[test]
fn constraint_errors_name_the_rule() {
    let err = |p, v, m, n| {
        let opts = Options { group: Some(n), ..Options::default() };
        generate(Kind::GroupedInterleaved, &Shape::new(p, v, m), &opts).unwrap_err().to_string()
    };
    assert!(err(4, 2, 8, 2).contains("needs group N >= p (N=2, p=4)"));
    assert!(err(4, 2, 8, 16).contains("needs group N <= m (N=16, m=8)"));
    assert!(err(4, 2, 10, 4).contains("multiple of group N (m=10, N=4)"));
    // Without a group (train and verify have no --group) the rule is said in ranks and microbatches.
    let default = |p, m| {
        generate(Kind::GroupedInterleaved, &Shape::new(p, 2, m), &Options::default()).unwrap_err().to_string()
    };
    let e = default(4, 2);
    assert!(
        e.contains("needs at least as many microbatches as ranks (m=2, p=4)") && !e.contains("group N"),
        "{e}"
    );
    let e = default(4, 6);
    assert!(e.contains("multiple of ranks p (m=6, p=4)") && !e.contains("group N"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn complete_deadlock_free_with_interleaved_bubble(
        p in 1usize..6, v in 1usize..4, extra in 0usize..3, groups in 1usize..4,
    ) {
        let n = p + extra;
        let m = n * groups;
        let s = gen(p, v, m, n);
        assert_complete(&s, m).map_err(TestCaseError::fail)?;
        for (stage, ranks) in s.placement() {
            prop_assert_eq!(ranks, vec![stage % p]);
        }
        let t = replay(&s, UNIT).map_err(TestCaseError::fail)?;
        let peaks = in_flight_peaks(&s);
        for (r, &peak) in peaks.iter().enumerate() {
            // (p−1)(t_f + t_b)/v in full-stage units = 3(p−1) chunk-units (docs/ARCHITECTURE.md).
            prop_assert_eq!(t.idle(r), 3.0 * (p as f64 - 1.0), "rank {}", r);
            let warmup = if v == 1 { p - 1 - r } else { (v - 1) * n + 2 * (p - 1 - r) };
            prop_assert_eq!(peak, (warmup + 1).min(m * v), "rank {}", r);
        }
    }
}
