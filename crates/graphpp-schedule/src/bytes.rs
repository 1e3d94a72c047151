//! Peak memory per rank in bytes: the simulator's memory model with each stage's real sizes in
//! place of M_B / M_W units (issue 12, item 3).
//!
//! The walk is the runtime's own accounting (`graphpp_runtime::stage`: a rank's activation peak is
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
//! The rank's peak is its resident bytes (parameters, gradients, AdamW moments, buffers) plus the
//! largest candidate. SEND/RECV and FSDP actions hold nothing here (FSDP's gathered parameters
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
    /// Bytes each rank holds for the whole step (index = rank): parameters, gradient
    /// accumulators, AdamW moments and buffers.
    pub resident: Vec<u64>,
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
    /// The schedule has more ranks than the model has resident figures for.
    #[error("the schedule has {ranks} ranks, the byte model resident bytes for {given}")]
    Ranks {
        /// Ranks of the schedule.
        ranks: usize,
        /// Entries of [`ByteModel::resident`].
        given: usize,
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
    /// [`BytesError::Stage`] for a stage without sizes.
    pub fn activation_peak(&self, schedule: &Schedule, rank: usize) -> Result<u64, BytesError> {
        let (mut held, mut peak) = (0i128, 0i128);
        for a in schedule.ranks[rank].iter().flatten() {
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
                            held -= s.held_fb as i128;
                            let c = held + s.run_i as i128;
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

    /// Peak bytes of every rank of `schedule`: resident plus [`ByteModel::activation_peak`].
    ///
    /// # Errors
    /// [`BytesError::Ranks`] when `resident` has fewer entries than the schedule has ranks;
    /// [`BytesError::Stage`] for a stage without sizes.
    pub fn peak_bytes(&self, schedule: &Schedule) -> Result<Vec<u64>, BytesError> {
        let ranks = schedule.num_ranks();
        if self.resident.len() < ranks {
            return Err(BytesError::Ranks { ranks, given: self.resident.len() });
        }
        (0..ranks).map(|r| Ok(self.resident[r] + self.activation_peak(schedule, r)?)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(held_fb: u64, held_iw: u64) -> StageBytes {
        StageBytes { held_fb, held_iw, run_f: 10, run_b: 20, run_i: 15, run_w: 5 }
    }

    #[test]
    fn the_walk_counts_held_pairs_and_the_running_graph() {
        // F0 F1 B0 B1 on one stage: F1 runs with F0's 100 held (100 + 10), B0 with F1's (100 + 20).
        let s = Schedule::from_csv("0F0,0F1,0B0,0B1\n").unwrap();
        let m = ByteModel { stages: vec![stage(100, 40)], resident: vec![1000], overlap: vec![] };
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
        let mut m = ByteModel { stages: vec![stage(100, 0)], resident: vec![0], overlap: vec![] };
        // The pair runs with F1's 100 held: 100 + (10 + 20).
        assert_eq!(m.activation_peak(&s, 0).unwrap(), 130);
        m.overlap.push(OverlapBytes { f: 0, b: 0, run: 500 });
        assert_eq!(m.activation_peak(&s, 0).unwrap(), 600);
    }

    #[test]
    fn a_stage_or_rank_without_sizes_is_named() {
        let s = Schedule::from_csv("0F0,1F0\n1B0,0B0\n").unwrap();
        let m = ByteModel { stages: vec![stage(1, 1)], resident: vec![0, 0], overlap: vec![] };
        let e = m.peak_bytes(&s).unwrap_err();
        assert_eq!(e, BytesError::Stage { rank: 0, action: "1F0".into(), stage: 1, stages: 1 });
        let m = ByteModel { stages: vec![stage(1, 1); 2], resident: vec![0], overlap: vec![] };
        assert_eq!(m.peak_bytes(&s).unwrap_err(), BytesError::Ranks { ranks: 2, given: 1 });
    }
}
