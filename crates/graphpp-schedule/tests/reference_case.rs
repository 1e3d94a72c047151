//! PyTorch's own DualPipeV case (`tests/data/torch_dualpipev/dualpipev_4rank_10mb.csv`, 4 ranks, 8 stages
//! in V placement, 10 microbatches) validates, and lowers to a valid schedule whose SEND/RECV
//! counts follow from the placement (docs/ARCHITECTURE.md: adjacent stages on one rank hand over locally).

use std::path::PathBuf;

use graphpp_schedule::{lower, validate, LowerOptions, Placement, Schedule, ValidateOptions};

fn case() -> Schedule {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_dualpipev/dualpipev_4rank_10mb.csv");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reference case {} is missing: {e}", path.display()));
    Schedule::from_csv(&text).unwrap()
}

#[test]
fn pytorch_dualpipev_case_validates() {
    let (p, stages, m) = (4, 8, 10);
    let sum = validate(&case(), &ValidateOptions::microbatches(m)).unwrap();
    assert_eq!((sum.ranks, sum.stages, sum.microbatches, sum.placement), (p, stages, m, Some(Placement::V)));
    let c = sum.counts;
    // Every (stage, microbatch) runs one forward and one backward (full, overlapped, or I + W).
    assert_eq!(c.f + c.overlap, stages * m);
    assert_eq!(c.b + c.overlap + c.i, stages * m);
    assert_eq!(c.i, c.w);
    assert!(c.overlap > 0 && c.i > 0, "{sum}");
}

#[test]
fn pytorch_dualpipev_case_lowers_to_a_valid_schedule() {
    let m = 10;
    let s = case();
    for fsdp in [None, Some(2), Some(3)] {
        let low = lower(&s, &LowerOptions { fsdp_max_unsharded: fsdp, ..Default::default() }).unwrap();
        let sum = validate(&low, &ValidateOptions::microbatches(m)).unwrap();
        // 7 stage boundaries, of which 3→4 is on rank 3: 6 cross-rank, each with a SEND_F and a
        // SEND_B (and matching RECVs) per microbatch.
        assert_eq!((sum.counts.send, sum.counts.recv), (6 * m * 2, 6 * m * 2));
        assert_eq!(low.compute_only(), s.compute_only());
        assert_eq!(sum.counts.reduce_grad, if fsdp.is_some() { 8 } else { 0 });
    }
}
