//! One call from a stage's forward graph to every graph the pipeline runtime needs:
//! {fw, full_bw, bw_di, bw_dw} (docs/ARCHITECTURE.md "Runtime" → Stage).

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

/// Which of a stage's graphs to show (`graphpp graph --show …`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GraphKind {
    /// Forward.
    Fw,
    /// Full backward.
    FullBw,
    /// Backward for the stage input.
    BwDi,
    /// Backward for the weights.
    BwDw,
    /// fw multiplexed with full_bw (comm-overlap order).
    Overlap,
}

impl GraphKind {
    /// Every kind, in the order `graphpp graph --stats` lists them.
    pub const ALL: [GraphKind; 5] =
        [GraphKind::Fw, GraphKind::FullBw, GraphKind::BwDi, GraphKind::BwDw, GraphKind::Overlap];

    /// The name `--show` takes (`fw`, `full_bw`, `bw_di`, `bw_dw`, `overlap`).
    pub fn name(self) -> &'static str {
        match self {
            GraphKind::Fw => "fw",
            GraphKind::FullBw => "full_bw",
            GraphKind::BwDi => "bw_di",
            GraphKind::BwDw => "bw_dw",
            GraphKind::Overlap => "overlap",
        }
    }
}

/// A graph name that is not one of [`GraphKind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown graph `{0}`; a stage's graphs are fw, full_bw, bw_di, bw_dw, overlap")]
pub struct UnknownGraphKind(pub String);

impl std::str::FromStr for GraphKind {
    type Err = UnknownGraphKind;
    fn from_str(s: &str) -> std::result::Result<Self, UnknownGraphKind> {
        GraphKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| UnknownGraphKind(s.to_string()))
    }
}

impl StageGraphs {
    /// The graph of `kind`. `Overlap` multiplexes this stage's fw with its own full_bw (two
    /// different microbatches) in comm-overlap order. Errors: `bw_di`/`bw_dw` on a first stage
    /// (it keeps full_bw only), or a pass error.
    pub fn select(&self, kind: GraphKind) -> Result<Graph> {
        let no_split = || crate::error::GraphError::Pass {
            pass: "split_di_dw".into(),
            graph: self.full_bw.name.clone(),
            reason: "a first stage has no input gradient and keeps full_bw only".into(),
        };
        Ok(match kind {
            GraphKind::Fw => self.fw.clone(),
            GraphKind::FullBw => self.full_bw.clone(),
            GraphKind::BwDi => self.di_dw.as_ref().ok_or_else(no_split)?.0.clone(),
            GraphKind::BwDw => self.di_dw.as_ref().ok_or_else(no_split)?.1.clone(),
            GraphKind::Overlap => crate::passes::multiplex_fw_bw(
                &self.fw,
                &self.full_bw,
                crate::passes::Multiplex::CommOverlap,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_kind_names_round_trip_and_unknown_lists_the_valid_ones() {
        for k in GraphKind::ALL {
            assert_eq!(k.name().parse::<GraphKind>().unwrap(), k);
        }
        let e = "bogus".parse::<GraphKind>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown graph `bogus`; a stage's graphs are fw, full_bw, bw_di, bw_dw, overlap"
        );
    }
}
