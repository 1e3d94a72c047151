//! PyTorch's own lowered schedules (`tests/data/torch_lowered/`, written by its `gen.py` from
//! PyTorch 2.15's `get_schedule_ops(..., with_comms=True)`) pass graphpp's validator: SEND/RECV
//! pairing, UNSHARD/RESHARD and REDUCE_GRAD rules, and the deadlock check. PyTorch's WAIT_*
//! actions (completion waits of asynchronous sends and reductions) have no counterpart in
//! graphpp's schedule IR; their cells are dropped before parsing. Our own lowering of the same
//! compute order must validate too.

use std::path::PathBuf;

use graphpp_schedule::{lower, validate, LowerOptions, Placement, Schedule, ValidateOptions};

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

fn without_waits(text: &str) -> String {
    text.lines()
        .map(|l| l.split(',').filter(|c| !c.contains("WAIT_")).collect::<Vec<_>>().join(",") + "\n")
        .collect()
}

#[test]
fn pytorch_lowered_schedules_validate() {
    let cases = cases();
    assert_eq!(cases.len(), 7, "fixtures missing");
    for (path, p, v, m) in cases {
        let s = Schedule::from_csv(&without_waits(&std::fs::read_to_string(&path).unwrap())).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let sum = validate(&s, &ValidateOptions { microbatches: Some(m) })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
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
        assert_eq!(sum.counts.unshard, sum.counts.reshard, "{name}");
        // Our own lowering of PyTorch's compute order is valid as well, with the same comm counts.
        let ours =
            lower(&s.compute_only(), &LowerOptions { fsdp_max_unsharded: Some(3), ..Default::default() })
                .unwrap();
        let ours_sum = validate(&ours, &ValidateOptions { microbatches: Some(m) })
            .unwrap_or_else(|e| panic!("{name}, our lowering: {e}"));
        assert_eq!(
            (ours_sum.counts.send, ours_sum.counts.recv),
            (sum.counts.send, sum.counts.recv),
            "{name}"
        );
    }
}
