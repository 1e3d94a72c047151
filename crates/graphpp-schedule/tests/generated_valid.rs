//! Every generator kind that accepts a shape yields a schedule that validates, lowers (with and
//! without FSDP actions) to a valid schedule, and has a topological order (no deadlock).

use graphpp_schedule::deps::DepGraph;
use graphpp_schedule::lower::{merge_bw, split_bw};
use graphpp_schedule::{generate, lower, validate, Kind, LowerOptions, Options, Shape, ValidateOptions};
use proptest::prelude::*;

fn check(kind: Kind, shape: Shape) -> Result<bool, TestCaseError> {
    let Ok(s) = generate(kind, &shape, &Options::default()) else { return Ok(false) };
    let m = shape.microbatches;
    let sum = validate(&s, &ValidateOptions::microbatches(m))
        .map_err(|e| TestCaseError::fail(format!("{kind} {shape:?}: {e}\n{s}")))?;
    prop_assert_eq!(sum.ranks, shape.ranks, "{} {:?}", kind, shape);
    prop_assert!(!sum.lowered);
    let order = DepGraph::build(&s).unwrap().topo_order();
    prop_assert!(order.is_ok(), "{} {:?}: no topological order", kind, shape);
    for opts in [LowerOptions::default(), LowerOptions { fsdp_max_unsharded: Some(2), ..Default::default() }]
    {
        let low = lower(&s, &opts).map_err(|e| TestCaseError::fail(format!("{kind} {shape:?}: {e}")))?;
        let lsum = validate(&low, &ValidateOptions::microbatches(m))
            .map_err(|e| TestCaseError::fail(format!("{kind} {shape:?} lowered: {e}\n{low}")))?;
        // One SEND_F and one SEND_B (and their RECVs) per cross-rank boundary of each route.
        let p = shape.ranks;
        let cross: usize = (0..m)
            .map(|j| {
                let r = s.route(j).unwrap();
                (r.start..r.end - 1)
                    .filter(|&b| kind.placement().rank_of(b, p) != kind.placement().rank_of(b + 1, p))
                    .count()
            })
            .sum();
        prop_assert_eq!((lsum.counts.send, lsum.counts.recv), (2 * cross, 2 * cross), "{} {:?}", kind, shape);
        prop_assert_eq!(low.compute_only(), s.compute_only());
    }
    if sum.counts.i == 0 {
        prop_assert_eq!(merge_bw(&split_bw(&s).unwrap()).unwrap(), s.clone());
    }
    Ok(true)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_generated_schedule_validates_and_lowers(p in 1usize..=6, v in 1usize..=3, m in 1usize..=16) {
        for kind in Kind::ALL {
            check(kind, Shape::new(p, v, m))?;
        }
    }
}

/// Not vacuous: at docs/ARCHITECTURE.md's reference shape (p = 4, m = 8) every kind serves v = 1 or v = 2,
/// and the checks above hold for it.
#[test]
fn every_kind_serves_the_reference_shape() {
    for kind in Kind::ALL {
        let served: Vec<usize> =
            (1..=2).filter(|&v| check(kind, Shape::new(4, v, 8)).unwrap_or_else(|e| panic!("{e}"))).collect();
        assert!(!served.is_empty(), "{kind} refuses p=4, m=8 with v=1 and v=2");
    }
}
