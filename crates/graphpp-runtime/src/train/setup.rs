//! What a training run is built from ([`TrainSetup`]): the model, the schedule and its shape,
//! the parallelism degrees, the optimizer and the run's bounds. Shared by the trainer, the
//! rank-local step and the checks built on them (`verify`, `profile`, `plan`).

use std::sync::Arc;
use std::time::Duration;

use graphpp_models::{Model, Recompute};
use graphpp_schedule::{Kind, Options, Schedule, Shape};

use crate::optim::lr::CosineSchedule;
use crate::optim::AdamWConfig;

/// Everything a training run is built from.
#[derive(Debug, Clone)]
pub struct TrainSetup {
    /// The model (any [`Model`]; the Llama config implements it).
    pub model: Arc<dyn Model>,
    /// Schedule kind.
    pub kind: Kind,
    /// Pipeline shape (p ranks, v stages per rank, m microbatches per step).
    pub shape: Shape,
    /// Generator options (group size, zb-auto costs).
    pub options: Options,
    /// A compute-only order of one's own (e.g. from a schedule file) run instead of `kind`'s
    /// generated one; it keeps `kind`'s placement ([`crate::train::build::compute_schedule`]).
    pub schedule: Option<Arc<Schedule>>,
    /// Decoder layers of each model stage; `None` splits evenly.
    pub layers_per_stage: Option<Vec<usize>>,
    /// Sequences per microbatch `B` (the global microbatch: each data-parallel replica runs
    /// `B / dp` of them).
    pub microbatch_size: usize,
    /// Data-parallel replicas of the pipeline (1: none); the world is `p × dp` ranks.
    pub dp: usize,
    /// FSDP (ZeRO-3) over the data-parallel replicas: parameters, gradients and AdamW state
    /// sharded ([`crate::pipeline::data_parallel`]); with dp = 1 the same as without.
    pub fsdp: bool,
    /// Expert-parallel degree (1: none): each MoE layer's routed experts are split over groups
    /// of `ep` data-parallel replicas, which exchange tokens by all-to-all ([`graphpp_comm::mesh`]);
    /// must divide dp and the routed experts.
    pub ep: usize,
    /// Optimizer post-validation (`--post-validate`, [`crate::train::rank_train::RankTrainer`]): step at once, validate
    /// the global norm after, roll back when clipping or a non-finite gradient says so.
    pub post_validate: bool,
    /// Tokens per sequence `T`.
    pub seq_len: usize,
    /// Seed of the initial weights.
    pub seed: u64,
    /// AdamW hyperparameters.
    pub adamw: AdamWConfig,
    /// Learning rate per step.
    pub lr: CosineSchedule,
    /// Global gradient-norm bound (`clip_grad_norm_`'s `max_norm`); `None` disables clipping.
    pub grad_clip: Option<f64>,
    /// Activation recomputation of every stage.
    pub recompute: Recompute,
    /// An emulated interconnect every rank's traffic goes through ([`graphpp_comm::emulated`]);
    /// `None`: the communicator as it is.
    pub link: Option<graphpp_comm::LinkModel>,
    /// Bias update speed γ of MoE load balancing, per step (DeepSeek-V3 uses 0.001; 0 freezes
    /// the biases); unused by a dense model.
    pub expert_bias_update: f64,
    /// Bound on every RECV of a step.
    pub timeout: Duration,
    /// Compute dtype of the stage graphs: f32, or bf16 for mixed precision (f32 master weights,
    /// gradients and AdamW state; bf16 activations and messages; f32 loss — see
    /// [`graphpp_models::StageOptions::mixed`]). Evaluation and generation compute in it too.
    pub dtype: graphpp_graph::DType,
}
