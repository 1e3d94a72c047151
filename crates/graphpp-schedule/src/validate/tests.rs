use super::*;

fn sched(csv: &str) -> Schedule {
    Schedule::from_csv(csv).unwrap()
}

fn check(csv: &str) -> Result<Summary, ValidationError> {
    validate(&sched(csv), &ValidateOptions::default())
}

fn err(csv: &str) -> ValidationError {
    check(csv).unwrap_err()
}

fn at(rank: RankId, step: usize, action: &str) -> Loc {
    Loc { rank, step, action: action.parse().unwrap() }
}

/// 2-rank 1F1B with m = 2, lowered by hand following docs/ARCHITECTURE.md's SEND/RECV rules.
const LOWERED: &str = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n\
                       1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n";

#[test]
fn summary_of_a_valid_schedule() {
    let s = check("0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n").unwrap();
    assert_eq!((s.ranks, s.stages, s.microbatches), (2, 2, 2));
    assert_eq!((s.counts.f, s.counts.b, s.placement, s.lowered), (4, 4, Some(Placement::Loop), false));
    assert_eq!(
        s.to_string(),
        "valid: 2 ranks, 2 stages (loop placement), 2 microbatches, compute-only; 4 F, 4 B"
    );
    let one = check("0F0,0B0\n").unwrap().to_string();
    assert!(one.starts_with("valid: 1 rank, 1 stage (loop placement), 1 microbatch,"), "{one}");
    let l = check(LOWERED).unwrap();
    assert_eq!((l.counts.send, l.counts.recv, l.lowered), (4, 4, true));
}

#[test]
fn v_placement_and_dualpipe_halves() {
    // p = 2, V placement: rank 0 holds stages 0 and 3, rank 1 holds 1 and 2; microbatch 0
    // runs 0..2 (first half), microbatch 1 runs 2..4 (second half), as in DualPipe.
    let s = check("0F0,3F1,3B1,0B0\n1F0,2F1,1B0,2B1\n").unwrap();
    assert_eq!((s.stages, s.microbatches, s.placement), (4, 2, Some(Placement::V)));
    // A route of 1..3 is neither all stages nor a half.
    let e = err("0F0,0B0,3F0,3B0\n1F1,2F1,2B1,1B1,1F0,2F0,2B0,1B0\n");
    assert_eq!(e, ValidationError::RouteMismatch { mb: 1, route: 1..3, stages: 4 });
}

#[test]
fn a_microbatch_that_skips_stages_is_refused() {
    // PyTorch's test suite: stage 1 runs F for microbatch 0 only (expected 2).
    let e = validate(&sched("0F0,0F1,0B0,0B1\n1F0,1B0\n"), &ValidateOptions::microbatches(2)).unwrap_err();
    assert_eq!(
        e,
        ValidationError::MixedRoutes { mb: 1, route: 0..1, other_mb: 0, other_route: 0..2, stages: 2 }
    );
    assert!(e.to_string().starts_with("microbatch 1 visits stages 0..1 but microbatch 0 visits 0..2"), "{e}");
    // Microbatch 0 only on stage 0.
    let e = err("0F0,0F1,0B0,0B1\n1F1,1B1\n");
    assert_eq!(
        e,
        ValidationError::MixedRoutes { mb: 0, route: 0..1, other_mb: 1, other_route: 0..2, stages: 2 }
    );
    // Each microbatch on one stage only, or two independent pipelines: halves, but not
    // DualPipe's mirrored directions.
    let e = err("0F0,0B0\n1F1,1B1\n");
    assert_eq!(e, ValidationError::HalvesNotMirrored { stage: 1, rank: 1, mirror: 0, mirror_rank: 0 });
    let e = err("0F0,0B0\n1F0,1B0\n2F1,2B1\n3F1,3B1\n");
    assert_eq!(e, ValidationError::HalvesNotMirrored { stage: 2, rank: 2, mirror: 1, mirror_rank: 1 });
    // Four stages, microbatch 1 only on the first two: a half, but the others are full routes.
    let e = err("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n2F0,2B0\n3F0,3B0\n");
    assert!(matches!(e, ValidationError::MixedRoutes { .. }), "{e}");
    // Only the upper half of a DualPipe layout: stages 0..2 run nothing.
    let e = err("3F0,3B0\n2F0,2B0\n");
    assert_eq!(e, ValidationError::StageWithoutCompute { stage: 0, stages: 4 });
}

#[test]
fn the_intended_shape_is_checked() {
    let idle = sched("0F0,0B0\n,,\n");
    // Without a shape: valid, the idle rank listed for a warning.
    let sum = validate(&idle, &ValidateOptions::default()).unwrap();
    assert_eq!((sum.ranks, sum.stages, sum.idle_ranks.clone()), (2, 1, vec![1]));
    let shape =
        |ranks, stages| ValidateOptions { microbatches: None, ranks: Some(ranks), stages: Some(stages) };
    assert_eq!(validate(&idle, &shape(2, 2)).unwrap_err(), ValidationError::IdleRank { rank: 1, ranks: 2 });
    assert_eq!(
        validate(&idle, &shape(3, 1)).unwrap_err(),
        ValidationError::RankCount { expected: 3, found: 2 }
    );
    let two = sched("0F0,0B0\n1F0,1B0\n");
    assert_eq!(
        validate(&two, &shape(2, 3)).unwrap_err(),
        ValidationError::StageCount { expected: 3, found: 2 }
    );
    assert!(validate(&two, &shape(2, 2)).unwrap().idle_ranks.is_empty());
}

#[test]
fn pytorch_wait_actions() {
    let waited = LOWERED
        .replace("0SEND_F1,", "0SEND_F1,0WAIT_SEND_F0,")
        .replace("1SEND_B1\n", "1SEND_B1,1WAIT_SEND_B1\n");
    let sum = check(&waited).unwrap();
    assert_eq!((sum.counts.wait_send, sum.counts.send), (2, 4));
    assert!(sum.to_string().ends_with("4 SEND, 4 RECV, 2 WAIT_SEND"), "{sum}");
    // A wait before its send, a repeated wait, a wait for a hand-over that does not exist.
    let e = err(&LOWERED.replace("0F0,0SEND_F0,", "0F0,0WAIT_SEND_F0,0SEND_F0,"));
    assert_eq!(
        e,
        ValidationError::WaitBeforeStart {
            at: at(0, 1, "0WAIT_SEND_F0"),
            start: "0SEND_F0".parse().unwrap()
        }
    );
    let e = err(&waited.replace("0WAIT_SEND_F0,", "0WAIT_SEND_F0,0WAIT_SEND_F0,"));
    assert!(matches!(e, ValidationError::DuplicateComm { .. }), "{e}");
    let e = err(&waited.replace("1WAIT_SEND_B1", "1WAIT_SEND_F1"));
    assert!(matches!(e, ValidationError::CommOutOfRoute { .. }), "{e}");
    // A send completes when its peer receives it: waiting for it before the peer can get to
    // its RECV deadlocks, where the same schedule without the wait is valid.
    let early = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n\
                 1RECV_F1,1F1,1RECV_F0,1F0,1B0,1SEND_B0,1B1,1SEND_B1\n";
    assert!(check(early).is_ok());
    let e = err(&early.replace("0F0,0SEND_F0,", "0F0,0SEND_F0,0WAIT_SEND_F0,"));
    let ValidationError::Deadlock { cycle } = &e else { panic!("{e:?}") };
    assert_eq!(cycle[0].at, at(0, 2, "0WAIT_SEND_F0"));
    // WAIT_REDUCE_GRAD: after its REDUCE_GRAD, once.
    assert_eq!(check("0F0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD\n").unwrap().counts.wait_reduce_grad, 1);
    let e = err("0F0,0B0,0WAIT_REDUCE_GRAD,0REDUCE_GRAD\n");
    assert_eq!(
        e,
        ValidationError::WaitBeforeStart {
            at: at(0, 2, "0WAIT_REDUCE_GRAD"),
            start: "0REDUCE_GRAD".parse().unwrap()
        }
    );
    let e = err("0F0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0WAIT_REDUCE_GRAD\n");
    assert!(matches!(e, ValidationError::DuplicateReduceGrad { .. }), "{e}");
    // A wait alone does not make REDUCE_GRAD required where the schedule has none.
    assert!(matches!(err("0F0,0B0,0WAIT_REDUCE_GRAD\n"), ValidationError::WaitBeforeStart { .. }));
}

#[test]
fn huge_stage_numbers_use_the_sparse_tables() {
    // S = 10^12 + 1: the dense tables would not fit; the error is the same as for small S.
    let e = err("0F0,1000000000000F0\n");
    assert_eq!(
        e,
        ValidationError::MissingCompute { kind: ComputeKind::B, task: Task::new(0, 0), rank: Some(0) }
    );
}

#[test]
fn empty() {
    assert_eq!(err(",\n"), ValidationError::Empty);
    assert_eq!(err("0UNSHARD,0RESHARD\n"), ValidationError::Empty);
}

#[test]
fn stage_on_many_ranks() {
    let e = err("0F0,0B0\n1F0,0F1,1B0\n");
    assert_eq!(e, ValidationError::StageOnManyRanks { stage: 0, first_rank: 0, at: at(1, 1, "0F1") });
    assert!(e.to_string().contains("rank 1 step 1 (`0F1`)"), "{e}");
    // The ranks' stages are gathered in parallel; the error is still the first in rank/step
    // order: not rank 2's, and not a later step of rank 1.
    let e = err("0F0,1F0,1B0,0B0\n2F0,1F1,0F1,2B0\n0F2,3F0\n");
    assert_eq!(e, ValidationError::StageOnManyRanks { stage: 1, first_rank: 0, at: at(1, 1, "1F1") });
}

#[test]
fn microbatch_out_of_range_and_missing() {
    let s = sched("0F0,0F1,0B0,0B1\n");
    let e = validate(&s, &ValidateOptions::microbatches(1)).unwrap_err();
    assert_eq!(e, ValidationError::MicrobatchOutOfRange { mb: 1, expected: 1, at: at(0, 1, "0F1") });
    let e = validate(&s, &ValidateOptions::microbatches(3)).unwrap_err();
    assert_eq!(e, ValidationError::MissingMicrobatch { mb: 2, expected: 3 });
    assert_eq!(err("0F0,0F2,0B0,0B2\n"), ValidationError::MissingMicrobatch { mb: 1, expected: 3 });
}

#[test]
fn missing_compute_of_each_kind() {
    let f = err("0F0,0B0\n1B0\n");
    assert_eq!(
        f,
        ValidationError::MissingCompute { kind: ComputeKind::F, task: Task::new(1, 0), rank: Some(1) }
    );
    let b = err("0F0\n1F0,1B0\n");
    assert_eq!(
        b,
        ValidationError::MissingCompute { kind: ComputeKind::B, task: Task::new(0, 0), rank: Some(0) }
    );
    assert!(b.to_string().contains("0B0 (or 0I0 with 0W0)"), "{b}");
    let w = err("0F0,0I0\n1F0,1B0\n");
    assert_eq!(
        w,
        ValidationError::MissingCompute { kind: ComputeKind::W, task: Task::new(0, 0), rank: Some(0) }
    );
}

#[test]
fn duplicate_compute() {
    let e = err("0F0,0B0,0F0\n");
    assert_eq!(
        e,
        ValidationError::DuplicateCompute {
            kind: ComputeKind::F,
            task: Task::new(0, 0),
            at: at(0, 2, "0F0"),
            first: at(0, 0, "0F0"),
        }
    );
    // The B half of an OVERLAP_F_B counts as the task's B.
    let e = err("0F0,0F1,0B0,(0F2;0B1)OVERLAP_F_B,0B1,0B2\n");
    assert!(matches!(e, ValidationError::DuplicateCompute { .. }), "{e}");
}

#[test]
fn mixed_backward_and_w_without_i() {
    let e = err("0F0,0B0,0I0,0W0\n");
    assert_eq!(
        e,
        ValidationError::MixedBackward { task: Task::new(0, 0), at: at(0, 2, "0I0"), other: at(0, 1, "0B0") }
    );
    assert_eq!(
        err("0F0,0B0,0W0\n"),
        ValidationError::WWithoutI { task: Task::new(0, 0), at: at(0, 2, "0W0") }
    );
}

#[test]
fn order_violations() {
    let e = err("0B0,0F0\n");
    assert_eq!(
        e,
        ValidationError::OrderViolation { at: at(0, 0, "0B0"), needs: "0F0".into(), needs_step: 1 }
    );
    let e = err("0F0,0W0,0I0\n");
    assert_eq!(
        e,
        ValidationError::OrderViolation { at: at(0, 1, "0W0"), needs: "0I0".into(), needs_step: 2 }
    );
    // F and B of one (stage, mb) inside one OVERLAP_F_B: B must come strictly after F.
    assert!(matches!(err("(0F0;0B0)OVERLAP_F_B\n"), ValidationError::OrderViolation { .. }));
}

#[test]
fn comm_errors() {
    // A SEND_F out of the last stage: there is no stage 2.
    let e = err(&LOWERED.replace("1B1,1SEND_B1", "1B1,1SEND_B1,1SEND_F1"));
    assert_eq!(e, ValidationError::CommOutOfRoute { at: at(1, 8, "1SEND_F1"), at_mb: 1, route: Some(0..2) });
    // Two stages on one rank hand over locally.
    let e = err("0F0,0SEND_F0,1RECV_F0,1F0,1B0,0B0\n");
    assert_eq!(e, ValidationError::LocalComm { at: at(0, 1, "0SEND_F0"), from: 0, to: 1 });
    // A dropped RECV_F names its peer SEND.
    let e = err(&LOWERED.replace("1RECV_F1,", ""));
    assert_eq!(
        e,
        ValidationError::MissingComm {
            rank: 1,
            missing: "1RECV_F1".parse().unwrap(),
            peer: Some(at(0, 3, "0SEND_F1"))
        }
    );
    assert_eq!(e.to_string(), "rank 1 has no `1RECV_F1` (its peer is at rank 0 step 3 (`0SEND_F1`))");
    let e = err(&LOWERED.replace("0SEND_F0,", "0SEND_F0,0SEND_F0,"));
    assert_eq!(e, ValidationError::DuplicateComm { at: at(0, 2, "0SEND_F0"), first: at(0, 1, "0SEND_F0") });
    let e = err(&LOWERED.replace("0B1\n", "0B1,3REDUCE_GRAD\n"));
    assert_eq!(e, ValidationError::UnknownStage { at: at(0, 8, "3REDUCE_GRAD"), stage: 3, stages: 2 });
}

#[test]
fn early_recv_deadlocks_with_its_cycle() {
    // Rank 1 posts RECV_F1 before producing 1B0's gradient; rank 0 waits for that gradient
    // before it sends 0F1's output: the early RECV deadlocks (docs/ARCHITECTURE.md, "Lowering passes").
    let e = err("0F0,0SEND_F0,0RECV_B0,0B0,0F1,0SEND_F1,0RECV_B1,0B1\n\
                 1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n");
    let ValidationError::Deadlock { cycle } = &e else { panic!("{e:?}") };
    let pairs: Vec<(Loc, Loc)> = cycle.iter().map(|w| (w.at, w.on)).collect();
    assert_eq!(
        pairs,
        vec![(at(0, 2, "0RECV_B0"), at(1, 4, "1SEND_B0")), (at(1, 1, "1RECV_F1"), at(0, 5, "0SEND_F1"))]
    );
}

#[test]
fn two_rank_deadlock_names_the_cycle() {
    // Rank 0 runs 0B0 (needs 1B0) before 0F1; rank 1 runs 1F1 (needs 0F1) before 1B0.
    let e = err("0F0,,,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n");
    let ValidationError::Deadlock { cycle } = &e else { panic!("{e:?}") };
    let pairs: Vec<(Loc, Loc)> = cycle.iter().map(|w| (w.at, w.on)).collect();
    assert_eq!(pairs, vec![(at(0, 3, "0B0"), at(1, 2, "1B0")), (at(1, 0, "1F1"), at(0, 4, "0F1"))]);
    assert_eq!(
        e.to_string(),
        "deadlock: rank 0 at step 3 (0B0) waits for 1B0 on rank 1; rank 1 at step 0 (1F1) waits for 0F1 on rank 0"
    );
}

#[test]
fn recv_after_its_consumer_is_a_wait_inside_one_rank() {
    let e = err("0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1RECV_F0,1B0,1SEND_B0\n");
    let ValidationError::Deadlock { cycle } = &e else { panic!("{e:?}") };
    assert_eq!(cycle, &vec![Wait { at: at(1, 0, "1F0"), on: at(1, 1, "1RECV_F0") }]);
    assert!(e.to_string().ends_with("rank 1 at step 0 (1F0) waits for 1RECV_F0 on rank 1"), "{e}");
}

#[test]
fn sharding_errors() {
    let ok = "0UNSHARD,0F0,0B0,0RESHARD\n";
    assert_eq!(check(ok).unwrap().counts.unshard, 1);
    let e = err("0UNSHARD,0F0,0RESHARD,0B0\n");
    assert_eq!(e, ValidationError::ComputeWhileSharded { at: at(0, 3, "0B0"), stage: 0 });
    let e = err("0UNSHARD,0F0,0UNSHARD,0B0,0RESHARD\n");
    assert_eq!(e, ValidationError::RedundantShardOp { at: at(0, 2, "0UNSHARD") });
    assert!(e.to_string().ends_with("already unsharded"), "{e}");
    let e = err("0UNSHARD,0F0,0B0,0RESHARD,0RESHARD\n");
    assert_eq!(e, ValidationError::RedundantShardOp { at: at(0, 4, "0RESHARD") });
    assert_eq!(err("0UNSHARD,0F0,0B0\n"), ValidationError::UnshardedAtEnd { rank: 0, stage: 0 });
}

#[test]
fn reduce_grad_errors() {
    assert_eq!(check("0F0,0I0,0W0,0REDUCE_GRAD\n").unwrap().counts.reduce_grad, 1);
    let e = err("0F0,0I0,0REDUCE_GRAD,0W0\n");
    assert_eq!(
        e,
        ValidationError::ReduceGradTooEarly { at: at(0, 2, "0REDUCE_GRAD"), last: at(0, 3, "0W0") }
    );
    let e = err("0F0,0B0,0REDUCE_GRAD,0REDUCE_GRAD\n");
    assert_eq!(
        e,
        ValidationError::DuplicateReduceGrad {
            at: at(0, 3, "0REDUCE_GRAD"),
            first: at(0, 2, "0REDUCE_GRAD")
        }
    );
    assert_eq!(err("0F0,0B0,0REDUCE_GRAD\n1F0,1B0\n"), ValidationError::MissingReduceGrad { stage: 1 });
}

/// A 68-byte file naming microbatch 4294967295 (or a SEND of a microbatch that large) is
/// refused before any table is sized by it: at once, naming the cell.
#[test]
fn a_microbatch_beyond_the_action_count_is_refused_before_tables_are_built() {
    let e = err("0F0,0F4294967295,0B4294967295,0B0\n1F0,1B0\n");
    assert_eq!(
        e,
        ValidationError::MicrobatchBeyondActions { mb: 4294967295, actions: 6, at: at(0, 1, "0F4294967295") }
    );
    assert!(e.to_string().contains("microbatch 4294967295 is beyond the schedule's 6 actions"), "{e}");
    let e = err("0F0,0SEND_F99,0B0\n1RECV_F0,1F0,1B0\n");
    assert!(matches!(e, ValidationError::MicrobatchBeyondActions { mb: 99, .. }), "{e}");
    // Within the count, a gap is the missing microbatch it always was.
    assert_eq!(
        err("0F0,0F2,0B0,0B2\n1F0,1F2,1B0,1B2\n"),
        ValidationError::MissingMicrobatch { mb: 1, expected: 3 }
    );
}
