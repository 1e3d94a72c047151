//! PyTorch's own lowered schedules (`tests/data/torch_lowered/`, written by its `gen.py` from
//! PyTorch 2.15's `get_schedule_ops(..., with_comms=True)`) pass graphpp's validator: SEND/RECV
//! pairing, UNSHARD/RESHARD and REDUCE_GRAD rules, the WAIT_* completion waits of asynchronous
//! sends and reductions, and the deadlock check. They are read with their WAIT actions, written
//! back unchanged, and simulated. Our own lowering of the same compute order must validate too.

use std::path::PathBuf;

use graphpp_schedule::{
    lower, simulate, validate, Action, CommKind, Costs, LowerOptions, Memory, Placement, Schedule,
    StageOpKind, ValidateOptions,
};

/// `(file stem, p, v, m)` parsed from `{class}_p{p}_v{v}_m{m}.csv`.
fn cases() -> Vec<(PathBuf, usize, usize, usize)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_lowered");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "csv"))
        .map(|path| {
            let stem = path.file_stem().unwrap().to_string_lossy().to_string();
            let num = |tag: &str| -> usize {
                let part = stem.split('_').find(|s| s.starts_with(tag)).unwrap();
                part[tag.len()..].parse().unwrap()
            };
            let (p, v, m) = (num("p"), num("v"), num("m"));
            (path, p, v, m)
        })
        .collect();
    out.sort();
    out
}

fn is_wait(a: &Action) -> bool {
    matches!(
        a,
        Action::Comm { kind: CommKind::WaitSendF | CommKind::WaitSendB, .. }
            | Action::StageOp { kind: StageOpKind::WaitReduceGrad, .. }
    )
}

#[test]
fn pytorch_lowered_schedules_validate() {
    let cases = cases();
    assert_eq!(cases.len(), 7, "fixtures missing");
    for (path, p, v, m) in cases {
        let text = std::fs::read_to_string(&path).unwrap();
        let s = Schedule::from_csv(&text).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        assert_eq!(s.to_csv(), text, "{name}: written back differently");
        let shape = ValidateOptions { microbatches: Some(m), ranks: Some(p), stages: Some(p * v) };
        let sum = validate(&s, &shape).unwrap_or_else(|e| panic!("{name}: {e}"));
        let stages = p * v;
        assert_eq!((sum.ranks, sum.stages, sum.microbatches, sum.lowered), (p, stages, m, true), "{name}");
        // Loop placement: every stage boundary crosses ranks; V: all but the one in the middle.
        let cross = match sum.placement {
            Some(Placement::Loop) => stages - 1,
            Some(Placement::V) => stages - 2,
            None => panic!("{name}: unexpected placement"),
        };
        assert_eq!((sum.counts.send, sum.counts.recv), (cross * m * 2, cross * m * 2), "{name}");
        assert_eq!(sum.counts.reduce_grad, stages, "{name}");
        // PyTorch waits for every send and every reduction it starts.
        assert_eq!(sum.counts.wait_send, sum.counts.send, "{name}");
        assert_eq!(sum.counts.wait_reduce_grad, stages, "{name}");
        // PyTorch places each wait where its send has been received already: with or without the
        // waits, the same makespan (also with a hop latency), and no deadlock.
        let no_waits = Schedule::from_programs(
            (0..p).map(|r| s.program(r).into_iter().filter(|a| !is_wait(a)).collect()).collect(),
        );
        for c in [0.0, 0.5] {
            let costs = Costs { comm: c, ..Costs::default() };
            let with = simulate(&s, &costs, &Memory::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
            let without = simulate(&no_waits, &costs, &Memory::default()).unwrap();
            assert_eq!(with.makespan, without.makespan, "{name}, c = {c}");
            assert!(with.timeline.intervals.len() > without.timeline.intervals.len(), "{name}");
        }
        assert_eq!(sum.counts.unshard, sum.counts.reshard, "{name}");
        // Our own lowering of PyTorch's compute order is valid as well, with the same comm counts.
        let ours =
            lower(&s.compute_only(), &LowerOptions { fsdp_max_unsharded: Some(3), ..Default::default() })
                .unwrap();
        let ours_sum = validate(&ours, &ValidateOptions::microbatches(m))
            .unwrap_or_else(|e| panic!("{name}, our lowering: {e}"));
        assert_eq!(
            (ours_sum.counts.send, ours_sum.counts.recv),
            (sum.counts.send, sum.counts.recv),
            "{name}"
        );
    }
}
