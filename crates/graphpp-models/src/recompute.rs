//! Activation recomputation (activation checkpointing) choices of a training run, resolved per
//! stage into a graph [`RecomputePolicy`] (docs/ARCHITECTURE.md "Graph IR": recompute policies
//! save less and recompute in the backward).

use graphpp_graph::RecomputePolicy;
use serde::{Deserialize, Serialize};

use crate::llama::{layer_checkpoints, StageSpec};

/// What the forward keeps for the backward (`--recompute`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recompute {
    /// Save every value the backward reads (no recomputation).
    SaveAll,
    /// Save every value the backward reads but the pointwise ones its fused ops recompute
    /// ([`RecomputePolicy::Pointwise`]: the SwiGLU's `σ(g)` and `g · σ(g)`, the norms' `x · r`):
    /// the losses of save-all bit for bit in less memory (`tiny`'s default `train`: peak 13.45 /
    /// 12.27 MiB per rank against 17.25 / 15.71).
    #[default]
    Pointwise,
    /// Save only the stage input; the backward recomputes the stage's whole forward (full
    /// activation checkpointing, Megatron's `--recompute-granularity full` per stage).
    StageInputs,
    /// Save matmul outputs; recompute the cheap elementwise and layout ops (selective).
    Matmuls,
    /// Save each decoder layer's residual stream (one checkpoint per layer, Chen et al. 2016).
    Layers,
}

impl Recompute {
    /// Every choice, in the order the help lists them.
    pub const ALL: [Recompute; 5] = [
        Recompute::SaveAll,
        Recompute::Pointwise,
        Recompute::StageInputs,
        Recompute::Matmuls,
        Recompute::Layers,
    ];

    /// The flag value: `save-all`, `pointwise`, `stage-inputs`, `matmuls`, `layers`.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::SaveAll => "save-all",
            Recompute::Pointwise => "pointwise",
            Recompute::StageInputs => "stage-inputs",
            Recompute::Matmuls => "matmuls",
            Recompute::Layers => "layers",
        }
    }

    /// The graph policy for the stage `spec`.
    pub fn policy(self, spec: &StageSpec) -> RecomputePolicy {
        match self {
            Recompute::SaveAll => RecomputePolicy::SaveAll,
            Recompute::Pointwise => RecomputePolicy::Pointwise,
            Recompute::StageInputs => RecomputePolicy::SaveStageInputs,
            Recompute::Matmuls => RecomputePolicy::SaveMatmuls,
            Recompute::Layers => RecomputePolicy::Checkpoints(layer_checkpoints(spec)),
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;

    /// Parses a flag value. Errors: the unknown value and the valid ones.
    fn from_str(s: &str) -> Result<Self, String> {
        Recompute::ALL.into_iter().find(|r| r.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Recompute::ALL.iter().map(|r| r.name()).collect();
            format!("unknown recompute policy `{s}` (one of: {})", names.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_layers_checkpoint_each_layer() {
        for r in Recompute::ALL {
            assert_eq!(r.name().parse::<Recompute>(), Ok(r));
            assert_eq!(serde_json::to_string(&r).unwrap(), format!("\"{}\"", r.name()));
        }
        assert!("all"
            .parse::<Recompute>()
            .unwrap_err()
            .contains("save-all, pointwise, stage-inputs, matmuls, layers"));
        let spec = StageSpec {
            stage: 1,
            stages: 2,
            layers: 2..4,
            ep: crate::ExpertShard::WHOLE,
            tp: crate::TensorShard::WHOLE,
        };
        let want = vec!["model.layers.2".to_string(), "model.layers.3".to_string()];
        assert_eq!(Recompute::Layers.policy(&spec), RecomputePolicy::Checkpoints(want));
    }
}
