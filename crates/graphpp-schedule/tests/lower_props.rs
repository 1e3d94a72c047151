//! Property tests of the lowering passes on hand-made valid schedules: the output validates,
//! SEND/RECV counts match the cross-rank boundaries, RECVs sit right before their consumer,
//! FSDP limits hold, and `merge_bw(split_bw(s)) == s`.

mod hand;

use std::collections::BTreeSet;

use graphpp_schedule::lower::{add_send_recv, merge_bw, split_bw};
use graphpp_schedule::{
    lower, validate, Action, CommKind, ComputeKind, LowerOptions, Schedule, StageOpKind, ValidateOptions,
    ValidationError,
};
use hand::{build, rank_of, stages, Family, FAMILIES};
use proptest::prelude::*;

fn shape() -> impl Strategy<Value = (Family, usize, usize)> {
    (prop::sample::select(FAMILIES.to_vec()), 1usize..=5, 1usize..=8)
}

fn cross_boundaries(f: Family, p: usize) -> usize {
    (0..stages(f, p) - 1).filter(|&s| rank_of(f, p, s) != rank_of(f, p, s + 1)).count()
}

/// The compute (kind, stage, mb) a RECV feeds: F for RECV_F, B or I for RECV_B.
fn consumes(recv: Action, a: Action) -> bool {
    match recv {
        Action::Comm { kind: CommKind::RecvF, task } => {
            a.computes().any(|(k, t)| k == ComputeKind::F && t == task)
        }
        Action::Comm { kind: CommKind::RecvB, task } => {
            a.computes().any(|(k, t)| matches!(k, ComputeKind::B | ComputeKind::I) && t == task)
        }
        _ => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn send_recv_lowering_stays_valid_with_expected_counts((f, p, m) in shape()) {
        let s = build(f, p, m);
        let low = lower(&s, &LowerOptions::default()).unwrap();
        let sum = validate(&low, &ValidateOptions::microbatches(m)).unwrap();
        let expected = cross_boundaries(f, p) * m * 2;
        prop_assert_eq!(sum.counts.send, expected);
        prop_assert_eq!(sum.counts.recv, expected);
        prop_assert_eq!(low.compute_only(), s.compute_only());
        prop_assert_eq!(sum.lowered, expected > 0);
    }

    #[test]
    fn recv_sits_right_before_its_consumer((f, p, m) in shape()) {
        let low = add_send_recv(&build(f, p, m)).unwrap();
        for r in 0..p {
            let prog = low.program(r);
            for (i, &a) in prog.iter().enumerate() {
                if matches!(a, Action::Comm { kind: CommKind::RecvF | CommKind::RecvB, .. }) {
                    let next = prog[i + 1..].iter().find(|x| x.is_compute()).copied();
                    prop_assert!(next.is_some_and(|n| consumes(a, n)), "{a} on rank {r} is followed by {next:?}");
                    let only_recvs = prog[i + 1..]
                        .iter()
                        .take_while(|x| !x.is_compute())
                        .all(|x| matches!(x, Action::Comm { kind: CommKind::RecvF | CommKind::RecvB, .. }));
                    prop_assert!(only_recvs, "rank {}: something other than a RECV between {} and its consumer", r, a);
                }
            }
        }
    }

    #[test]
    fn fsdp_lowering_stays_valid_and_bounded((f, p, m) in shape(), n in 1usize..=3) {
        let s = build(f, p, m);
        let low = lower(&s, &LowerOptions { fsdp_max_unsharded: Some(n), ..Default::default() }).unwrap();
        let sum = validate(&low, &ValidateOptions::default()).unwrap();
        prop_assert_eq!(sum.counts.reduce_grad, stages(f, p));
        prop_assert_eq!(sum.counts.unshard, sum.counts.reshard);
        for r in 0..p {
            let mut live = BTreeSet::new();
            for a in low.program(r) {
                match a {
                    Action::StageOp { kind: StageOpKind::Unshard, stage } => { live.insert(stage); }
                    Action::StageOp { kind: StageOpKind::Reshard, stage } => { live.remove(&stage); }
                    _ => {}
                }
                prop_assert!(live.len() <= n, "rank {r}: {} stages unsharded, max {n}", live.len());
            }
        }
    }

    #[test]
    fn merge_inverts_split((f, p, m) in shape()) {
        prop_assume!(!matches!(f, Family::Zb));
        let s = build(f, p, m);
        let split = split_bw(&s).unwrap();
        let sum = validate(&split, &ValidateOptions::default()).unwrap();
        prop_assert_eq!((sum.counts.b, sum.counts.i, sum.counts.w), (0, s.compute_only().ranks.iter().flatten().count() / 2, s.compute_only().ranks.iter().flatten().count() / 2));
        prop_assert_eq!(merge_bw(&split).unwrap(), s);
    }

    #[test]
    fn merge_keeps_zb_valid(p in 1usize..=5, m in 1usize..=8) {
        let merged = merge_bw(&hand::zb(p, m)).unwrap();
        let sum = validate(&merged, &ValidateOptions::default()).unwrap();
        // Rank 0 runs each W right after its I, so all of its m backward pairs merge.
        prop_assert!(sum.counts.b >= m);
        prop_assert_eq!(sum.counts.b + sum.counts.i, p * m);
    }

    #[test]
    fn dropping_a_comm_action_is_rejected((f, p, m) in shape(), which in any::<prop::sample::Index>()) {
        prop_assume!(cross_boundaries(f, p) > 0);
        let low = lower(&build(f, p, m), &LowerOptions::default()).unwrap();
        let comm: Vec<(usize, usize)> = (0..p)
            .flat_map(|r| low.program(r).into_iter().enumerate().filter(|(_, a)| matches!(a, Action::Comm { .. })).map(move |(i, _)| (r, i)).collect::<Vec<_>>())
            .collect();
        let (r, i) = comm[which.index(comm.len())];
        let mut programs: Vec<Vec<Action>> = (0..p).map(|k| low.program(k)).collect();
        let dropped = programs[r].remove(i);
        let e = validate(&Schedule::from_programs(programs), &ValidateOptions::default()).unwrap_err();
        prop_assert!(matches!(e, ValidationError::MissingComm { rank, missing, .. } if rank == r && missing == dropped), "{e:?}");
    }
}
