//! DualPipeV must reproduce PyTorch's own expected schedule byte for byte
//! (`shared/cases/torch/dualpipev_4rank_10mb.csv`: 4 ranks, 8 stages, 10 microbatches, `\n` line
//! ends, trailing newline).

use std::path::PathBuf;

use graphpp_schedule::{generate, Kind, Options, Schedule, Shape};

fn case_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/cases/torch/dualpipev_4rank_10mb.csv")
}

#[test]
fn dualpipev_matches_pytorch_case_byte_for_byte() {
    let path = case_path();
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reference case {} is missing: {e}", path.display()));
    let s = generate(Kind::DualPipeV, &Shape::new(4, 2, 10), &Options::default()).unwrap();
    let got = s.to_csv_with(",", "\n");
    if got != expected {
        for (r, (g, x)) in got.lines().zip(expected.lines()).enumerate() {
            assert_eq!(g, x, "rank {r} differs");
        }
        assert_eq!(got, expected);
    }
    // And the case parses back into the very same schedule.
    assert_eq!(Schedule::from_csv(&expected).unwrap(), s);
}
