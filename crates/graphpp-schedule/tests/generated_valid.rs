//! Every generator kind that accepts a shape yields a schedule that validates, lowers (with and
//! without FSDP actions) to a valid schedule, and has a topological order (no deadlock); the
//! simulation on the validator's walk equals one over the dependency graph's topological order.

use graphpp_schedule::deps::{ActionRef, DepGraph};
use graphpp_schedule::lower::{merge_bw, split_bw};
use graphpp_schedule::simulate::duration;
use graphpp_schedule::{
    generate, lower, simulate, validate, validated, Costs, Kind, LowerOptions, Memory, Options, Schedule,
    Shape, ValidateOptions,
};
use proptest::prelude::*;

/// Each rank's action end times in program order, simulated over [`DepGraph::topo_order`]: an
/// action starts when the one before it on its rank and each dependency have ended, a dependency
/// on another rank `costs.comm` later.
fn ends_by_topo_order(s: &Schedule, costs: &Costs) -> Vec<Vec<f64>> {
    let g = DepGraph::build(s).unwrap();
    let mut end = vec![0.0f64; g.len()];
    for at in g.topo_order().unwrap() {
        let before = (at.index > 0).then(|| end[g.global(ActionRef { rank: at.rank, index: at.index - 1 })]);
        let start = g
            .deps(at)
            .iter()
            .map(|d| end[g.global(d.on)] + if d.hop { costs.comm } else { 0.0 })
            .fold(before.unwrap_or(0.0), f64::max);
        end[g.global(at)] = start + duration(&g.action(at), costs);
    }
    (0..s.num_ranks())
        .map(|r| (0..g.programs[r].len()).map(|i| end[g.global(ActionRef { rank: r, index: i })]).collect())
        .collect()
}

/// [`Validated::simulate`](graphpp_schedule::Validated::simulate) equals [`simulate`] and the
/// topological-order simulation, with a hop latency so that cross-rank edges count.
fn check_simulation(s: &Schedule, what: &str) -> Result<(), TestCaseError> {
    let costs = Costs { comm: 0.25, comm_action: 0.125, ..Costs::default() };
    let shared =
        validated(s, &ValidateOptions::default()).unwrap().simulate(&costs, &Memory::default()).unwrap();
    prop_assert_eq!(&shared, &simulate(s, &costs, &Memory::default()).unwrap(), "{}", what);
    let by_rank: Vec<Vec<f64>> =
        shared.timeline.by_rank().iter().map(|row| row.iter().map(|i| i.end).collect()).collect();
    prop_assert_eq!(by_rank, ends_by_topo_order(s, &costs), "{}", what);
    Ok(())
}

fn check(kind: Kind, shape: Shape) -> Result<bool, TestCaseError> {
    let Ok(s) = generate(kind, &shape, &Options::default()) else { return Ok(false) };
    let m = shape.microbatches;
    let sum = validate(&s, &ValidateOptions::microbatches(m))
        .map_err(|e| TestCaseError::fail(format!("{kind} {shape:?}: {e}\n{s}")))?;
    prop_assert_eq!(sum.ranks, shape.ranks, "{} {:?}", kind, shape);
    prop_assert!(!sum.lowered);
    let order = DepGraph::build(&s).unwrap().topo_order();
    prop_assert!(order.is_ok(), "{} {:?}: no topological order", kind, shape);
    check_simulation(&s, &format!("{kind} {shape:?}"))?;
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
        check_simulation(&low, &format!("{kind} {shape:?} lowered"))?;
    }
    if sum.counts.i == 0 {
        prop_assert_eq!(merge_bw(&split_bw(&s).unwrap()).unwrap(), s.clone());
    }
    Ok(true)
}

/// Idle cells and a rank without cells between two that talk, the first waiting on the last
/// one's first cell (whose global index is also where the empty rank starts): the shared-walk
/// simulation still equals the others, compute-only and lowered.
#[test]
fn idle_cells_and_an_empty_rank() {
    let mut s = Schedule::parse("1F0,1B0,,1F1,1B1\n\n0F0,,0F1,,0B0,0B1\n").unwrap();
    // The CSV's empty line is one idle cell; no cell at all is the case to see.
    s.ranks[1].clear();
    check_simulation(&s, "compute-only").unwrap();
    let low = lower(&s, &LowerOptions::default()).unwrap();
    check_simulation(&low, "lowered").unwrap();
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
