//! Stage → rank placement (docs/ARCHITECTURE.md glossary, "placement").

/// How stages map to ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Stage `s` on rank `s mod p` (Megatron interleaving, PyTorch's default).
    Loop,
    /// Rank `r` holds stages `r` and `2p-1-r` (ZB-V, DualPipeV; `v = 2` only).
    V,
}

impl Placement {
    /// `loop` or `V`, as summaries and the Python package name it.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Loop => "loop",
            Placement::V => "V",
        }
    }

    /// The rank that holds `stage` with `p` ranks. For [`Placement::V`], `stage < 2p`.
    pub fn rank_of(self, stage: usize, p: usize) -> usize {
        match self {
            Placement::Loop => stage % p,
            Placement::V => {
                if stage < p {
                    stage
                } else {
                    2 * p - 1 - stage
                }
            }
        }
    }

    /// The stages rank `r` holds, in chunk order (chunk 0 first), for `p` ranks and `v` stages per rank.
    pub fn stages_of(self, r: usize, p: usize, v: usize) -> Vec<usize> {
        match self {
            Placement::Loop => (0..v).map(|c| c * p + r).collect(),
            Placement::V => vec![r, 2 * p - 1 - r],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_and_loop() {
        assert_eq!(Placement::V.rank_of(7, 4), 0);
        assert_eq!(Placement::V.rank_of(4, 4), 3);
        assert_eq!(Placement::Loop.rank_of(6, 4), 2);
        assert_eq!(Placement::Loop.stages_of(1, 4, 3), vec![1, 5, 9]);
        assert_eq!(Placement::V.stages_of(1, 4, 2), vec![1, 6]);
    }
}
