//! Peak memory per rank in bytes: the simulator's memory model with each stage's real sizes in
//! place of M_B / M_W units.
//!
//! The walk is the runtime's own accounting (`graphpp_runtime::pipeline::stage`: a rank's activation peak is
//! the largest, over the compute actions it runs, of the bytes the other (stage, microbatch) pairs
//! hold plus the running graph's peak live bytes), so a [`ByteModel`] built from the stage graphs
//! predicts what a run measures. Per rank, in program order:
//! - F of stage s: peak candidate = held + `run_f[s]`; then held += `held_fb[s]`;
//! - B: held −= `held_fb[s]`; candidate = held + `run_b[s]`;
//! - I: held −= `held_fb[s]`; candidate = held + `run_i[s]`; then held += `held_iw[s]`;
//! - W: held −= `held_iw[s]`; candidate = held + `run_w[s]`;
//! - OVERLAP_F_B(f, b): held −= `held_fb[b]`; candidate = held + the pair's run bytes; then
//!   held += `held_fb[f]`.
//!
//! The rank's peak is its resident bytes — the `resident` bytes (parameters, gradients, AdamW
//! moments, buffers) of every stage the schedule places on it — plus the largest candidate. SEND/RECV and FSDP actions hold nothing here (FSDP's gathered parameters
//! are not modelled).

use crate::action::{Action, ComputeKind};
use crate::schedule::Schedule;

/// Bytes of one stage for one microbatch (logical sizes, `numel × dtype size`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StageBytes {
    /// Held from F until B or I: the forward's values the backward reads (M_B in bytes).
    pub held_fb: u64,
    /// Held from I until W: what W reads that I leaves (M_W in bytes).
    pub held_iw: u64,
    /// Peak live bytes while F runs (its activation inputs, intermediates and outputs).
    pub run_f: u64,
    /// Peak live bytes while the full backward B runs.
    pub run_b: u64,
    /// Peak live bytes while I (input-gradient backward) runs; 0 for a stage without the split.
    pub run_i: u64,
    /// Peak live bytes while W (weight-gradient backward) runs.
    pub run_w: u64,
    /// Bytes the stage holds for the whole step: its parameters, their gradient accumulators
    /// and AdamW moments, and its buffers.
    pub resident: u64,
}

/// Peak live bytes of one OVERLAP_F_B pair's multiplexed graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OverlapBytes {
    /// The forward half's stage.
    pub f: usize,
    /// The backward half's stage.
    pub b: usize,
    /// Peak live bytes while the pair runs.
    pub run: u64,
}

/// The byte sizes of a schedule's stages and ranks.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ByteModel {
    /// Per schedule stage (index = stage id).
    pub stages: Vec<StageBytes>,
    /// OVERLAP_F_B pairs; a pair not listed runs in `run_f[f] + run_b[b]`.
    #[serde(default)]
    pub overlap: Vec<OverlapBytes>,
}

/// A schedule the byte model does not cover.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BytesError {
    /// An action names a stage the model has no sizes for.
    #[error("rank {rank}: {action} runs stage {stage}, but the byte model has {stages} stages")]
    Stage {
        /// The rank.
        rank: usize,
        /// The action, as text.
        action: String,
        /// Its stage.
        stage: usize,
        /// Stages in the model.
        stages: usize,
    },
    /// The schedule places a stage the model has no sizes for.
    #[error("stage {stage} is placed on a rank, but the byte model has {stages} stages")]
    Placed {
        /// The stage.
        stage: usize,
        /// Stages in the model.
        stages: usize,
    },
    /// A rank the schedule does not have.
    #[error("rank {rank}: the schedule has {ranks} ranks")]
    Rank {
        /// The rank asked for.
        rank: usize,
        /// Ranks of the schedule.
        ranks: usize,
    },
}

impl ByteModel {
    fn stage(&self, rank: usize, a: &Action, stage: usize) -> Result<&StageBytes, BytesError> {
        self.stages.get(stage).ok_or_else(|| BytesError::Stage {
            rank,
            action: a.to_string(),
            stage,
            stages: self.stages.len(),
        })
    }

    /// Peak live bytes of OVERLAP_F_B(`f`, `b`).
    fn overlap_run(&self, f: &StageBytes, b: &StageBytes, fs: usize, bs: usize) -> u64 {
        self.overlap.iter().find(|o| o.f == fs && o.b == bs).map_or(f.run_f + b.run_b, |o| o.run)
    }

    /// Peak activation bytes of `rank`'s program (the walk of the module doc, without the
    /// resident bytes).
    ///
    /// # Errors
    /// [`BytesError::Rank`] for a rank the schedule lacks; [`BytesError::Stage`] for a stage
    /// without sizes.
    pub fn activation_peak(&self, schedule: &Schedule, rank: usize) -> Result<u64, BytesError> {
        let program =
            schedule.ranks.get(rank).ok_or(BytesError::Rank { rank, ranks: schedule.num_ranks() })?;
        let (mut held, mut peak) = (0i128, 0i128);
        for a in program.iter().flatten() {
            let candidate = match *a {
                Action::Compute { kind, task } => {
                    let s = self.stage(rank, a, task.stage)?;
                    match kind {
                        ComputeKind::F => {
                            let c = held + s.run_f as i128;
                            held += s.held_fb as i128;
                            c
                        }
                        ComputeKind::B => {
                            held -= s.held_fb as i128;
                            held + s.run_b as i128
                        }
                        ComputeKind::I => {
                            // A stage without the split runs no graph at I (run_i = 0).
                            held -= s.held_fb as i128;
                            let c = if s.run_i > 0 { held + s.run_i as i128 } else { 0 };
                            held += s.held_iw as i128;
                            c
                        }
                        ComputeKind::W => {
                            held -= s.held_iw as i128;
                            held + s.run_w as i128
                        }
                    }
                }
                Action::Overlap { f, b } => {
                    let (fs, bs) = (self.stage(rank, a, f.stage)?, self.stage(rank, a, b.stage)?);
                    held -= bs.held_fb as i128;
                    let c = held + self.overlap_run(fs, bs, f.stage, b.stage) as i128;
                    held += fs.held_fb as i128;
                    c
                }
                Action::Comm { .. } | Action::StageOp { .. } => continue,
            };
            peak = peak.max(candidate);
        }
        Ok(peak.max(0) as u64)
    }

    /// Resident bytes of every rank of `schedule`: those of the stages placed on it.
    ///
    /// # Errors
    /// [`BytesError::Placed`] for a stage without sizes.
    pub fn resident(&self, schedule: &Schedule) -> Result<Vec<u64>, BytesError> {
        let mut out = vec![0u64; schedule.num_ranks()];
        for (stage, ranks) in schedule.placement() {
            let s = self.stages.get(stage).ok_or(BytesError::Placed { stage, stages: self.stages.len() })?;
            for r in ranks {
                out[r] += s.resident;
            }
        }
        Ok(out)
    }

    /// Peak bytes of every rank of `schedule`: [`ByteModel::resident`] plus
    /// [`ByteModel::activation_peak`].
    ///
    /// # Errors
    /// [`BytesError::Placed`], [`BytesError::Stage`] for a stage without sizes.
    pub fn peak_bytes(&self, schedule: &Schedule) -> Result<Vec<u64>, BytesError> {
        let resident = self.resident(schedule)?;
        (0..schedule.num_ranks()).map(|r| Ok(resident[r] + self.activation_peak(schedule, r)?)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(held_fb: u64, held_iw: u64) -> StageBytes {
        StageBytes { held_fb, held_iw, run_f: 10, run_b: 20, run_i: 15, run_w: 5, resident: 1000 }
    }

    #[test]
    fn the_walk_counts_held_pairs_and_the_running_graph() {
        // F0 F1 B0 B1 on one stage: F1 runs with F0's 100 held (100 + 10), B0 with F1's (100 + 20).
        let s = Schedule::from_csv("0F0,0F1,0B0,0B1\n").unwrap();
        let m = ByteModel { stages: vec![stage(100, 40)], overlap: vec![] };
        assert_eq!(m.peak_bytes(&s).unwrap(), vec![1000 + 120]);
        // F0 F1 I0 W0 I1 W1: I0 runs with F1's 100 (115); W0 with F1's 100 + nothing of its own
        // (105); I1 with nothing held (15); the peak is I0's 115.
        let s = Schedule::from_csv("0F0,0F1,0I0,0W0,0I1,0W1\n").unwrap();
        assert_eq!(m.activation_peak(&s, 0).unwrap(), 115);
        // Three F, then I and W: F2 runs with 200 held (210), I0 with F1's and F2's 200 (215), I1
        // with F2's 100 and I0's stash 40 (155).
        let s = Schedule::from_csv("0F0,0F1,0F2,0I0,0I1,0I2,0W0,0W1,0W2\n").unwrap();
        assert_eq!(m.activation_peak(&s, 0).unwrap(), 215);
    }

    #[test]
    fn overlap_pairs_use_their_own_peak_or_the_sum() {
        let s = Schedule::from_csv("0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\n").unwrap();
        let mut m = ByteModel { stages: vec![stage(100, 0)], overlap: vec![] };
        // The pair runs with F1's 100 held: 100 + (10 + 20).
        assert_eq!(m.activation_peak(&s, 0).unwrap(), 130);
        m.overlap.push(OverlapBytes { f: 0, b: 0, run: 500 });
        assert_eq!(m.activation_peak(&s, 0).unwrap(), 600);
    }

    #[test]
    fn a_stage_or_rank_without_sizes_is_named() {
        let s = Schedule::from_csv("0F0,1F0\n1B0,0B0\n").unwrap();
        let m = ByteModel { stages: vec![stage(1, 1)], overlap: vec![] };
        let e = m.activation_peak(&s, 0).unwrap_err();
        assert_eq!(e, BytesError::Stage { rank: 0, action: "1F0".into(), stage: 1, stages: 1 });
        assert_eq!(m.activation_peak(&s, 2).unwrap_err(), BytesError::Rank { rank: 2, ranks: 2 });
        assert_eq!(m.peak_bytes(&s).unwrap_err(), BytesError::Placed { stage: 1, stages: 1 });
    }

    #[test]
    fn each_rank_holds_the_resident_bytes_of_its_stages() {
        // Two stages on rank 0 (a V's ends), one on rank 1.
        let s = Schedule::from_csv("0F0,2F0,2B0,0B0\n1F0,1B0\n").unwrap();
        let mut m = ByteModel { stages: vec![stage(0, 0); 3], overlap: vec![] };
        m.stages[2].resident = 7;
        assert_eq!(m.resident(&s).unwrap(), vec![1007, 1000]);
    }
}
