//! One call from a stage's forward graph to every graph the pipeline runtime needs:
//! {fw, full_bw, bw_di, bw_dw} (DESIGN.md "Runtime" → Stage).

use crate::autodiff::autodiff;
use crate::error::Result;
use crate::graph::Graph;
use crate::partition::{partition, RecomputePolicy};
use crate::passes::split_di_dw;

/// The graphs of one stage.
#[derive(Clone, Debug, PartialEq)]
pub struct StageGraphs {
    /// Forward: user outputs (`output` or `loss`) then `saved.<n>`.
    pub fw: Graph,
    /// Full backward: outputs `grad.<param>` … and `grad.input` (not on a first stage).
    pub full_bw: Graph,
    /// `Some((bw_di, bw_dw))` unless the stage has no input gradient (first stage).
    pub di_dw: Option<(Graph, Graph)>,
    /// Saved value names (fw outputs → bw inputs).
    pub saved: Vec<String>,
    /// dI → dW stash names (bw_di outputs → bw_dw inputs).
    pub stash: Vec<String>,
}

/// Autodiff, partition under `policy`, and dI/dW split of a stage forward graph `forward`
/// (inputs named per [`crate::names`]). Errors: any pass error.
pub fn stage_graphs(forward: &Graph, policy: &RecomputePolicy) -> Result<StageGraphs> {
    let joint = autodiff(forward)?;
    let p = partition(&joint, forward.outputs.len(), policy)?;
    let split = split_di_dw(&p.full_bw)?;
    let stash = split.as_ref().map(|s| s.stash.clone()).unwrap_or_default();
    Ok(StageGraphs {
        fw: p.fw,
        full_bw: p.full_bw,
        di_dw: split.map(|s| (s.bw_di, s.bw_dw)),
        saved: p.saved,
        stash,
    })
}
