//! The seed tutorial's summary table (`001_…`, final comparison of schedules), computed: for one
//! shape, every kind's bubble, peak activations and point-to-point messages.

use crate::costs::{Costs, Memory};
use crate::deps::DepGraph;
use crate::generate::{check_size, generate, GenerateError, Kind, Options, Shape};
use crate::simulate::simulate;

/// One row of the comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct CompareRow {
    /// The kind.
    pub kind: Kind,
    /// v used.
    pub stages_per_rank: usize,
    /// Figures, or the reason the kind cannot serve the shape.
    pub result: Result<CompareFigures, String>,
}

/// Figures of one kind at one shape (cost units; M_B units).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CompareFigures {
    /// Simulated makespan.
    pub makespan: f64,
    /// In-iteration r_bubble.
    pub bubble_ratio: f64,
    /// In-iteration idle fraction.
    pub idle_fraction: f64,
    /// Largest per-rank peak in-flight activation (M_B units).
    pub peak_activations: f64,
    /// Cross-rank messages (activations + gradients) per microbatch.
    pub messages_per_microbatch: f64,
}

/// Cross-rank messages per microbatch of a compute-only schedule: dependencies that hop ranks.
pub fn messages_per_microbatch(g: &DepGraph, microbatches: usize) -> f64 {
    let hops = g.all_deps().iter().filter(|d| d.hop).count();
    hops as f64 / microbatches.max(1) as f64
}

/// The factor a chunk's cost is of a full stage's: 1/v for v equal chunks per rank, 1 for
/// DualPipe (each of its two stages per rank is a full stage of one parameter copy).
pub fn chunk_cost_factor(kind: Kind, v: usize) -> f64 {
    kind.model_copies() as f64 / v as f64
}

/// The factor a chunk's cost is of a full stage's in `schedule` (v = stages / ranks chunks per
/// rank): [`chunk_cost_factor`] when its `kind` is known, else 1/v (a schedule file's kind is
/// unknown: DualPipe's two parameter copies are not told apart).
pub fn schedule_chunk_factor(kind: Option<Kind>, schedule: &crate::Schedule) -> f64 {
    let v = (schedule.num_stages() / schedule.num_ranks().max(1)).max(1);
    kind.map_or(1.0 / v as f64, |k| chunk_cost_factor(k, v))
}

/// `costs` with every action duration multiplied by `factor` (the hop latency c is kept; an unset
/// T_overlap stays T_F + T_B of the scaled costs).
pub fn scale_costs(costs: &Costs, factor: f64) -> Costs {
    Costs {
        f: costs.f * factor,
        b: costs.b * factor,
        i: costs.i * factor,
        w: costs.w * factor,
        overlap: costs.overlap.map(|o| o * factor),
        ..*costs
    }
}

/// Every kind at `p` ranks and `m` microbatches with full-stage `costs` and the memory model
/// `memory` (both reach the cost- and memory-aware generators and the simulator). Kinds with v
/// chunks per rank run each chunk at 1/v of the full-stage costs (see [`chunk_cost_factor`]), so
/// every row does the same work per rank and makespans compare directly.
///
/// # Errors
/// [`GenerateError::TooLarge`] for the first kind whose schedule would be too large to build
/// (checked for every kind before any is built; the table is all or nothing).
pub fn compare(p: usize, m: usize, costs: &Costs, memory: &Memory) -> Result<Vec<CompareRow>, GenerateError> {
    for kind in Kind::ALL {
        check_size(kind, &Shape::new(p, kind.default_stages_per_rank(), m))?;
    }
    Ok(Kind::ALL
        .iter()
        .map(|&kind| {
            let v = kind.default_stages_per_rank();
            let costs = scale_costs(costs, chunk_cost_factor(kind, v));
            let opts = Options { costs, memory: *memory, ..Options::default() };
            let result =
                generate(kind, &Shape::new(p, v, m), &opts).map_err(|e| e.to_string()).and_then(|s| {
                    let r = simulate(&s, &costs, memory).map_err(|e| e.to_string())?;
                    let g = DepGraph::build(&s).map_err(|e| e.to_string())?;
                    Ok(CompareFigures {
                        makespan: r.makespan,
                        bubble_ratio: r.bubble_ratio,
                        idle_fraction: r.idle_fraction,
                        peak_activations: r.peak_activations.iter().copied().fold(0.0, f64::max),
                        messages_per_microbatch: messages_per_microbatch(&g, m),
                    })
                });
            CompareRow { kind, stages_per_rank: v, result }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_too_large_for_one_kind_is_refused_before_building() {
        // 10^6 ranks × 8 microbatches: GPipe and 1F1B would build 1.6·10^7 actions (under the
        // limit), interleaved 1F1B (v = 2) 3.2·10^7, the first kind over it; nothing is built
        // before the refusal.
        let e = compare(1_000_000, 8, &Costs::default(), &Memory::default()).unwrap_err();
        assert!(
            matches!(e, GenerateError::TooLarge { kind: Kind::Interleaved1F1B, ranks: 1_000_000, .. }),
            "{e:?}"
        );
        assert_eq!(compare(4, 8, &Costs::default(), &Memory::default()).unwrap().len(), Kind::ALL.len());
    }
}
