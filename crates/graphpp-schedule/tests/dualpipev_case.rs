//! DualPipeV must reproduce PyTorch's schedules byte for byte: PyTorch's own expected case
//! (`tests/data/torch_dualpipev/dualpipev_4rank_10mb.csv`, copied from PyTorch's
//! `test/distributed/pipelining/artifacts/`: 4 ranks, 8 stages, 10 microbatches, `\n` line ends,
//! trailing newline) and the sweep in the same folder (see its README).

use std::path::PathBuf;

use graphpp_schedule::{generate, Kind, Options, Schedule, Shape};

fn case_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_dualpipev/dualpipev_4rank_10mb.csv")
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

#[test]
fn dualpipev_matches_pytorch_sweep() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_dualpipev");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("dualpipev_").and_then(|n| n.strip_suffix("mb.csv")) else {
            continue;
        };
        let (p, m) = rest.split_once("rank_").unwrap_or_else(|| panic!("bad case name {name}"));
        let (p, m): (usize, usize) = (p.parse().unwrap(), m.parse().unwrap());
        let expected = std::fs::read_to_string(&path).unwrap();
        let s = generate(Kind::DualPipeV, &Shape::new(p, 2, m), &Options::default()).unwrap();
        assert_eq!(s.to_csv(), expected, "{name}");
        checked += 1;
    }
    assert_eq!(checked, 19, "expected 19 PyTorch cases in {}", dir.display());
}
