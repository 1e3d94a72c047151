//! Profiles: what a training run measured per stage — the mean time of each
//! F, B, I, W and OVERLAP_F_B — beside the byte model of its stage graphs
//! ([`graphpp_schedule::bytes`]) and the peak bytes each rank measured, saved as JSON.
//! `graphpp schedule simulate --profile FILE` simulates any schedule of the same stages with
//! these times and bytes; `graphpp plan --profile FILE` calibrates its cost model with them.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use graphpp_graph::{DType, Graph, Op, StageGraphs};
use graphpp_models::Recompute;
use graphpp_runtime::train::{build::run_stage_graphs, bytes::byte_model};
use graphpp_schedule::bytes::ByteModel;
use graphpp_schedule::{Action, ComputeKind, Kind, Schedule, Timeline};
use serde::{Deserialize, Serialize};

use crate::train::{train_setup, RunConfig};

/// Something per compute kind (F, B, I, W).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PerKind<T> {
    /// F.
    pub f: T,
    /// B (full backward).
    pub b: T,
    /// I (input-gradient backward).
    pub i: T,
    /// W (weight-gradient backward).
    pub w: T,
}

impl<T: Copy + Default> PerKind<T> {
    /// `f` of each compute kind's graph of a stage — fw, full_bw, bw_di and bw_dw; a stage
    /// without the dI/dW split (a model's first stage) does nothing at I (`T::default()`) and
    /// runs full_bw at W, as the runtime does.
    pub fn of_stage(g: &StageGraphs, f: impl Fn(&Graph) -> T) -> PerKind<T> {
        let b = f(&g.full_bw);
        let (i, w) = match &g.di_dw {
            Some((di, dw)) => (f(di), f(dw)),
            None => (T::default(), b),
        };
        PerKind { f: f(&g.fw), b, i, w }
    }
}

impl<T: Copy> PerKind<T> {
    /// The value of `kind`.
    pub fn get(&self, kind: ComputeKind) -> T {
        match kind {
            ComputeKind::F => self.f,
            ComputeKind::B => self.b,
            ComputeKind::I => self.i,
            ComputeKind::W => self.w,
        }
    }

    fn get_mut(&mut self, kind: ComputeKind) -> &mut T {
        match kind {
            ComputeKind::F => &mut self.f,
            ComputeKind::B => &mut self.b,
            ComputeKind::I => &mut self.i,
            ComputeKind::W => &mut self.w,
        }
    }
}

/// The work of one graph run: its matmul FLOPs and the bytes every other node writes (the
/// elementwise, reduction and data-movement work that matmul FLOPs miss — on a CPU often most of
/// a small model's time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Work {
    /// Multiply-add FLOPs of the matmuls ([`Graph::matmul_flops`]).
    pub flops: u64,
    /// Logical bytes of the values of every node that is neither an input nor a product
    /// ([`Op::is_product`]: its cost is in `flops`) nor a member of a fused group other than its
    /// anchor (computed in registers, never written: `graphpp_runtime::exec::fusion`).
    pub bytes: u64,
}

impl Work {
    /// The work of one run of `g` as its compiled program runs it.
    pub fn of(g: &Graph) -> Work {
        let mut w = Work::default();
        for cost in node_costs(g) {
            match cost {
                NodeCost::Product { flops, .. } => w.flops += flops,
                NodeCost::Written { bytes } => w.bytes += bytes,
            }
        }
        w
    }
}

/// What one node of a compiled program costs (see [`node_costs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeCost {
    /// A product (matmul, attention, segment matmul): its multiply-add FLOPs
    /// ([`Graph::node_flops`]).
    Product {
        /// FLOPs.
        flops: u64,
        /// Whether it is an attention op (forward or backward): its products are small
        /// per-head tiles beside softmax, so it runs at its own rate
        /// ([`crate::hardware::Device::attention_curve`]).
        attention: bool,
    },
    /// Any other node the program writes: its value's logical bytes.
    Written {
        /// Bytes.
        bytes: u64,
    },
}

/// The cost of every node of `g` as its compiled program runs it ([`indexed_node_costs`]).
pub fn node_costs(g: &Graph) -> Vec<NodeCost> {
    indexed_node_costs(g).into_iter().map(|(_, c)| c).collect()
}

/// The cost of every node of `g` that costs something as its compiled program runs it, with the
/// node's index: products by their FLOPs, every other node it writes by its bytes; inputs, and
/// fused group members other than the anchor (computed in registers, never written:
/// `graphpp_runtime::exec::fusion`), cost nothing and are left out.
pub fn indexed_node_costs(g: &Graph) -> Vec<(usize, NodeCost)> {
    let fusion = graphpp_runtime::exec::fusion::plan(g);
    let written = |i: usize| fusion.member_of[i].is_none_or(|k| fusion.groups[k].anchor == i);
    g.nodes
        .iter()
        .enumerate()
        .filter_map(|(i, n)| match g.node_flops(graphpp_graph::ValueId(i)) {
            Some(flops) => {
                let attention = matches!(n.op, Op::Attention { .. } | Op::AttentionBackward { .. });
                Some((i, NodeCost::Product { flops, attention }))
            }
            None if !matches!(n.op, Op::Input { .. }) && written(i) => {
                Some((i, NodeCost::Written { bytes: n.ty.size_bytes() as u64 }))
            }
            None => None,
        })
        .collect()
}

/// The work of each compute kind of a stage (one microbatch): fw, full_bw, bw_di and bw_dw; a
/// stage without the dI/dW split (a model's first stage) does nothing at I and runs full_bw at
/// W, as the runtime does.
pub fn stage_work(graphs: &StageGraphs) -> PerKind<Work> {
    PerKind::of_stage(graphs, Work::of)
}

/// How fast a rank computes: seconds per matmul FLOP and per byte written by other nodes. An
/// action of [`Work`] `w` takes `w.flops · seconds_per_flop + w.bytes · seconds_per_byte`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Speed {
    /// Seconds per matmul FLOP.
    pub seconds_per_flop: f64,
    /// Seconds per byte written by a node that is not a matmul.
    pub seconds_per_byte: f64,
}

impl Default for Speed {
    /// 50 GFLOP/s of matmuls (what `graphpp train` reports for `tiny` on one core of a 2-core
    /// CI machine: 62–65 GFLOP/s) and 5 GB/s of other nodes' output.
    fn default() -> Self {
        Speed { seconds_per_flop: 1.0 / 50e9, seconds_per_byte: 1.0 / 5e9 }
    }
}

impl Speed {
    /// Seconds of `w`.
    pub fn seconds(&self, w: Work) -> f64 {
        w.flops as f64 * self.seconds_per_flop + w.bytes as f64 * self.seconds_per_byte
    }

    /// The speed that best explains `samples` of (work, measured seconds): least squares over
    /// both rates; when that gives a negative or undefined rate (too few or collinear
    /// samples), the default speed scaled by one least-squares factor. `None` for no sample.
    pub fn fit(samples: &[(Work, f64)]) -> Option<Speed> {
        if samples.is_empty() {
            return None;
        }
        let (mut ff, mut fy, mut yy, mut tf, mut ty) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for (w, t) in samples {
            let (f, y) = (w.flops as f64, w.bytes as f64);
            ff += f * f;
            fy += f * y;
            yy += y * y;
            tf += t * f;
            ty += t * y;
        }
        let det = ff * yy - fy * fy;
        let (a, b) = ((tf * yy - ty * fy) / det, (ty * ff - tf * fy) / det);
        if det > 1e-9 * ff * yy && a.is_finite() && b.is_finite() && a > 0.0 && b > 0.0 {
            return Some(Speed { seconds_per_flop: a, seconds_per_byte: b });
        }
        let d = Speed::default();
        let x: Vec<f64> = samples.iter().map(|(w, _)| d.seconds(*w)).collect();
        let xx: f64 = x.iter().map(|x| x * x).sum();
        let k = samples.iter().zip(&x).map(|((_, t), x)| t * x).sum::<f64>() / xx;
        (k.is_finite() && k > 0.0).then_some(Speed {
            seconds_per_flop: k * d.seconds_per_flop,
            seconds_per_byte: k * d.seconds_per_byte,
        })
    }
}

/// One schedule stage of a profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageProfile {
    /// Schedule stage id.
    pub stage: usize,
    /// Mean measured seconds of each kind on this stage; `None` where the run never ran it.
    pub seconds: PerKind<Option<f64>>,
    /// Work of each kind ([`stage_work`]).
    pub work: PerKind<Work>,
}

/// The mean measured time of one OVERLAP_F_B pair of stages.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OverlapProfile {
    /// The forward half's stage.
    pub f: usize,
    /// The backward half's stage.
    pub b: usize,
    /// Mean seconds.
    pub seconds: f64,
}

/// What a run measured and its byte model (see the module doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Model name as given.
    pub model: String,
    /// Schedule kind of the run.
    pub schedule: Kind,
    /// p.
    pub ranks: usize,
    /// v.
    pub stages_per_rank: usize,
    /// m.
    pub microbatches: usize,
    /// B (over the replicas).
    pub microbatch_size: usize,
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel degree: the times and bytes are one tp rank's, its in-graph tp
    /// collectives included (absent in profiles made before tensor parallelism: 1).
    #[serde(default = "crate::train::one")]
    pub tp: usize,
    /// Sequence parallelism over the tp ranks.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// T.
    pub seq_len: usize,
    /// Recompute policy.
    pub recompute: Recompute,
    /// Compute dtype.
    pub dtype: DType,
    /// Steps whose times the means are over.
    pub steps: usize,
    /// Per schedule stage.
    pub stages: Vec<StageProfile>,
    /// OVERLAP_F_B pairs the run ran.
    pub overlap: Vec<OverlapProfile>,
    /// The byte model of the run's stage graphs.
    pub bytes: ByteModel,
    /// Peak bytes each pipeline rank of replica 0 measured (the largest over the steps).
    pub measured_peak_bytes: Vec<u64>,
    /// Peak bytes the byte model predicts for the run's schedule.
    pub predicted_peak_bytes: Vec<u64>,
}

/// Why a profile cannot be made, read or used.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not a profile.
    #[error("{path}: not a graphpp profile: {source}")]
    Json {
        /// The file.
        path: String,
        /// The cause.
        source: serde_json::Error,
    },
    /// Building the stage graphs or the byte model failed.
    #[error("{0}")]
    Build(String),
    /// DualPipe's stages (two copies of a p-stage split) against another kind's.
    #[error("the profile is of {profile}, the schedule {schedule}: DualPipe's 2p stages are two copies of p, so their layers differ")]
    Copies {
        /// The profile's kind.
        profile: Kind,
        /// The schedule's kind.
        schedule: Kind,
    },
    /// The profile does not fit the schedule it is used with: its stage graphs are another
    /// split of the model.
    #[error(
        "the profile has {profile} stages (it ran {kind}), the schedule {schedule}: a profile times \
         one split of the model; profile a run with {schedule} stages (for a V or interleaved kind: \
         `graphpp profile --schedule zbv` or that kind, with the same --ranks)"
    )]
    Stages {
        /// Stages of the profile.
        profile: usize,
        /// The kind the profile ran.
        kind: Kind,
        /// Stages of the schedule.
        schedule: usize,
    },
}

/// Mean seconds of each (stage, kind) and of each OVERLAP_F_B pair over `timelines`.
fn mean_seconds(timelines: &[Timeline]) -> (BTreeMap<(usize, ComputeKind), f64>, Vec<OverlapProfile>) {
    let mut acc: BTreeMap<(usize, ComputeKind), (f64, usize)> = BTreeMap::new();
    let mut pairs: BTreeMap<(usize, usize), (f64, usize)> = BTreeMap::new();
    for i in timelines.iter().flat_map(|t| &t.intervals) {
        let slot = match i.action {
            Action::Compute { kind, task } => acc.entry((task.stage, kind)).or_default(),
            Action::Overlap { f, b } => pairs.entry((f.stage, b.stage)).or_default(),
            _ => continue,
        };
        slot.0 += i.end - i.start;
        slot.1 += 1;
    }
    let per = acc.into_iter().map(|(k, (s, n))| (k, s / n as f64)).collect();
    let overlap =
        pairs.into_iter().map(|((f, b), (s, n))| OverlapProfile { f, b, seconds: s / n as f64 }).collect();
    (per, overlap)
}

impl Profile {
    /// The profile of a run of `config` whose (lowered) `schedule` ran the steps of
    /// `timelines` (seconds) with each pipeline rank of replica 0 peaking at `peaks` bytes.
    ///
    /// # Errors
    /// [`ProfileError::Build`] when the stage graphs or the byte model cannot be built.
    pub fn of_run(
        config: &RunConfig,
        schedule: &Schedule,
        timelines: &[Timeline],
        peaks: &[u64],
    ) -> Result<Profile, ProfileError> {
        let build = |e: &dyn std::fmt::Display| ProfileError::Build(e.to_string());
        let setup = train_setup(config).map_err(|e| build(&e))?;
        let graphs: Vec<Arc<StageGraphs>> = run_stage_graphs(&setup).map_err(|e| build(&e))?;
        let refs: Vec<&StageGraphs> = graphs.iter().map(|g| &**g).collect();
        let bytes = byte_model(&refs, schedule).map_err(|e| build(&e))?;
        let predicted_peak_bytes = bytes.peak_bytes(schedule).map_err(|e| build(&e))?;
        let (per, overlap) = mean_seconds(timelines);
        let stages = graphs
            .iter()
            .enumerate()
            .map(|(stage, g)| {
                let mut seconds = PerKind::<Option<f64>>::default();
                for kind in [ComputeKind::F, ComputeKind::B, ComputeKind::I, ComputeKind::W] {
                    *seconds.get_mut(kind) = per.get(&(stage, kind)).copied();
                }
                StageProfile { stage, seconds, work: stage_work(g) }
            })
            .collect();
        Ok(Profile {
            model: config.model_name.clone(),
            schedule: config.kind,
            ranks: config.ranks,
            stages_per_rank: config.stages_per_rank,
            microbatches: config.microbatches,
            microbatch_size: config.microbatch_size,
            dp: config.dp,
            tp: config.tp,
            sequence_parallel: config.sequence_parallel,
            seq_len: config.seq_len,
            recompute: config.recompute,
            dtype: config.dtype,
            steps: timelines.len(),
            stages,
            overlap,
            bytes,
            measured_peak_bytes: peaks.to_vec(),
            predicted_peak_bytes,
        })
    }

    /// Reads a profile written by [`Profile::save`].
    ///
    /// # Errors
    /// [`ProfileError::Io`], [`ProfileError::Json`].
    pub fn load(path: &Path) -> Result<Profile, ProfileError> {
        let name = path.display().to_string();
        let text = crate::textfile::read_text(path)
            .map_err(|source| ProfileError::Io { path: name.clone(), source })?;
        serde_json::from_str(&text).map_err(|source| ProfileError::Json { path: name, source })
    }

    /// Writes the profile as JSON, atomically (a killed run leaves the old file or the new one).
    ///
    /// # Errors
    /// [`ProfileError::Io`].
    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        let text = serde_json::to_string_pretty(self).expect("a profile serialises");
        crate::checkpoint::write_file_atomic(path, (text + "\n").as_bytes())
            .map_err(|source| ProfileError::Io { path: path.display().to_string(), source })
    }

    /// Checks that `schedule` (of `kind`, when known) runs this profile's stages: as many, and
    /// DualPipe's two copies of a p-stage split only where the profile has them too (its `2p`
    /// stages hold other layers than `2p` stages of any other kind).
    ///
    /// # Errors
    /// [`ProfileError::Stages`], [`ProfileError::Copies`].
    pub fn check(&self, schedule: &Schedule, kind: Option<Kind>) -> Result<(), ProfileError> {
        let stages = schedule.num_stages();
        if stages != self.stages.len() {
            return Err(ProfileError::Stages {
                profile: self.stages.len(),
                kind: self.schedule,
                schedule: stages,
            });
        }
        if let Some(k) = kind.filter(|&k| k.model_copies() != self.schedule.model_copies()) {
            return Err(ProfileError::Copies { profile: self.schedule, schedule: k });
        }
        Ok(())
    }

    /// Mean measured seconds of `kind` over the stages that ran it (`None`: none did).
    pub fn kind_mean(&self, kind: ComputeKind) -> Option<f64> {
        let v: Vec<f64> = self.stages.iter().filter_map(|s| s.seconds.get(kind)).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }

    /// Seconds of `a` by this profile: a compute action's stage and kind as measured — a kind
    /// the run never ran on that stage (B in a run of I and W) from the stage's other kinds
    /// (B = I + W, I = W = B / 2; on a stage without the dI/dW split I = 0 and W = B), else the
    /// kind's mean over stages; an OVERLAP_F_B pair as
    /// measured, else its halves' sum; SEND, RECV and FSDP actions 0.
    pub fn duration(&self, a: &Action) -> f64 {
        match *a {
            Action::Compute { kind, task } => self.compute_seconds(task.stage, kind),
            Action::Overlap { f, b } => {
                self.overlap.iter().find(|o| (o.f, o.b) == (f.stage, b.stage)).map_or_else(
                    || {
                        self.compute_seconds(f.stage, ComputeKind::F)
                            + self.compute_seconds(b.stage, ComputeKind::B)
                    },
                    |o| o.seconds,
                )
            }
            Action::Comm { .. } | Action::StageOp { .. } => 0.0,
        }
    }

    fn compute_seconds(&self, stage: usize, kind: ComputeKind) -> f64 {
        let Some(s) = self.stages.get(stage).map(|s| s.seconds) else {
            return self.kind_mean(kind).unwrap_or(0.0);
        };
        // A stage without the dI/dW split (its I has no work) runs nothing at I and full_bw at W.
        let split = self.stages[stage].work.i != Work::default();
        let derived = match kind {
            ComputeKind::B => s.i.zip(s.w).map(|(i, w)| i + w),
            ComputeKind::I if !split => Some(0.0),
            ComputeKind::W if !split => s.b,
            ComputeKind::I | ComputeKind::W => s.b.map(|b| b / 2.0),
            ComputeKind::F => None,
        };
        s.get(kind).or(derived).or_else(|| self.kind_mean(kind)).unwrap_or(0.0)
    }

    /// The [`Speed`] fitted to every measured (stage, kind) of the profile ([`Speed::fit`]).
    pub fn speed(&self) -> Option<Speed> {
        let kinds = [ComputeKind::F, ComputeKind::B, ComputeKind::I, ComputeKind::W];
        let samples: Vec<(Work, f64)> = self
            .stages
            .iter()
            .flat_map(|s| kinds.iter().filter_map(|&k| s.seconds.get(k).map(|t| (s.work.get(k), t))))
            .collect();
        Speed::fit(&samples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_speed_fit_recovers_both_rates_or_scales_the_default() {
        let truth = Speed { seconds_per_flop: 2e-11, seconds_per_byte: 3e-10 };
        let works = [Work { flops: 1_000_000, bytes: 50_000 }, Work { flops: 300_000, bytes: 400_000 }];
        let samples: Vec<(Work, f64)> = works.iter().map(|w| (*w, truth.seconds(*w))).collect();
        let fit = Speed::fit(&samples).unwrap();
        assert!((fit.seconds_per_flop / truth.seconds_per_flop - 1.0).abs() < 1e-9, "{fit:?}");
        assert!((fit.seconds_per_byte / truth.seconds_per_byte - 1.0).abs() < 1e-9, "{fit:?}");
        // One sample cannot separate the rates: the default is scaled to explain it exactly.
        let one = Speed::fit(&samples[..1]).unwrap();
        assert!((one.seconds(works[0]) / samples[0].1 - 1.0).abs() < 1e-9, "{one:?}");
        let d = Speed::default();
        assert!(
            (one.seconds_per_byte / one.seconds_per_flop - d.seconds_per_byte / d.seconds_per_flop).abs()
                < 1e-3
        );
        assert_eq!(Speed::fit(&[]), None);
    }

    #[test]
    fn work_counts_what_a_compiled_program_writes() {
        // x [4, 8] → e = exp(x) → m = e · x → mm = m · w: e is fused into m's group (never
        // written); m is written (32 f32), as is nothing else but the product (in FLOPs).
        let mut b = graphpp_graph::GraphBuilder::new("work", DType::F32);
        let x = b.input("x", graphpp_graph::InputKind::Activation, vec![4, 8]).unwrap();
        let w = b.input("w", graphpp_graph::InputKind::Parameter, vec![8, 2]).unwrap();
        let e = b.exp(x).unwrap();
        let m = b.mul(e, x).unwrap();
        let mm = b.matmul(m, w).unwrap();
        b.output("mm", mm);
        let g = b.finish().unwrap();
        assert_eq!(Work::of(&g), Work { flops: g.matmul_flops(), bytes: 4 * 32 });
    }
}
