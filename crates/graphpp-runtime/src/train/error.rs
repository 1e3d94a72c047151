//! The error of setting a training run up: the schedule, the stage split, the stage graphs, the
//! mesh and the rank's thread pool. Building is shared by `train`, `verify`, `profile` and
//! `plan`; each wraps this error in its own ([`crate::TrainError::Setup`],
//! [`crate::VerifyError::Setup`]).

use graphpp_comm::MeshError;
use graphpp_graph::GraphError;
use graphpp_models::ModelError;
use graphpp_schedule::{GenerateError, LowerError};

use crate::exec::ExecError;
use crate::optim::OptimError;
use crate::pipeline::stage::StageError;
use crate::pipeline::PipelineError;
use crate::train::memory::SizeError;
use crate::train::sample::SampleError;

/// Why a run's schedule, stages or ranks could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// More pipeline stages than decoder layers.
    #[error(
        "the model has {layers} decoder {}, too few for the {stages} model stages {kind} splits it into at \
         p={ranks}, v={stages_per_rank} (one layer at least per stage); use a model with more layers \
         (--layers), fewer ranks, or fewer stages per rank where the kind allows it",
        if *.layers == 1 { "layer" } else { "layers" }
    )]
    TooFewLayers {
        /// Decoder layers of the model.
        layers: usize,
        /// Model stages the shape needs (S = p·v, or p for DualPipe).
        stages: usize,
        /// The schedule kind.
        kind: graphpp_schedule::Kind,
        /// p.
        ranks: usize,
        /// v.
        stages_per_rank: usize,
    },
    /// A schedule given as data (a file) that does not fit the run: another shape, another
    /// placement than its kind's, or not compute-only ([`crate::train::build::compute_schedule`]).
    #[error("{0}")]
    ScheduleFile(String),
    /// The kind cannot serve the shape.
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// A bf16 run whose `GRAPHPP_BF16_GEMM` names no bf16 matmul path this process can run.
    #[error(transparent)]
    Bf16Path(#[from] crate::kernels::bf16_gemm::PathError),
    /// `GRAPHPP_KERNELS` names no choice of kernels, or a device cannot be opened.
    #[error(transparent)]
    Device(#[from] crate::kernels::device::DeviceError),
    /// The step would be too large to run (schedule size or memory), from estimates.
    #[error(transparent)]
    Size(#[from] SizeError),
    /// Lowering the schedule failed.
    #[error(transparent)]
    Lower(#[from] LowerError),
    /// Bad model config or split.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A graph pass failed.
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// The mesh does not fit the world or names a rank outside it.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// A tensor operation failed (initial weights).
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    /// An initial parameter is missing or has another shape than its graph's input.
    #[error("initial parameter {name}: {reason}")]
    Parameter {
        /// The parameter's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The schedule, the stages, the mesh and the communicator do not agree (a schedule stage
    /// without a model stage, a rank outside its pipeline, another world size, ...).
    #[error("{0}")]
    Inconsistent(String),
    /// The OS refused a rank's thread pool.
    #[error("rank {rank}: thread pool: {reason}")]
    ThreadPool {
        /// The rank.
        rank: usize,
        /// The OS's reason.
        reason: String,
    },
}

/// Why training could not start or a step failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Building the schedule, the stage split, the stage graphs or the mesh failed.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// A step's pipeline run failed (names the rank, step and action).
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// A single-device graph (evaluation, generation) failed.
    #[error("single-device step: {0}")]
    Exec(#[from] ExecError),
    /// The step would be too large to run (schedule size or memory), from estimates.
    #[error(transparent)]
    Size(#[from] SizeError),
    /// The optimizer, clipping or a loaded optimizer state was rejected.
    #[error("optimizer: {0}")]
    Optim(#[from] OptimError),
    /// A stage rejected loaded parameters.
    #[error("loading parameters: {0}")]
    Stage(#[from] StageError),
    /// Sampling a token failed (e.g. NaN logits after a diverged run).
    #[error("generation: {0}")]
    Sample(#[from] SampleError),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    /// A step's data does not fit the trainer (wrong microbatch count, shape or token id).
    #[error("bad step data: {0}")]
    Data(String),
    /// A collective after the pipeline run failed (a timeout, another rank's abort).
    #[error("collective: {0}")]
    Comm(Box<graphpp_comm::CommError>),
    /// The microbatch's sequences do not split evenly over the data-parallel replicas.
    #[error("batch {batch} does not divide into {dp} data-parallel replicas (dp must be ≥ 1 and divide the batch)")]
    BatchNotDivisible {
        /// Sequences per microbatch.
        batch: usize,
        /// Data-parallel replicas.
        dp: usize,
    },
    /// Expert parallelism that this run cannot have: a degree that does not divide dp or the
    /// routed experts, a dense model, or FSDP with it.
    #[error("--ep {ep}: {reason}")]
    ExpertParallel {
        /// The expert-parallel degree asked for.
        ep: usize,
        /// What is wrong.
        reason: String,
    },
    /// A tensor-parallel degree the model cannot take: 0, or not dividing its heads, key/value
    /// heads or MLP width.
    #[error("--tp {tp}: {reason}")]
    TensorParallel {
        /// The tensor-parallel degree asked for.
        tp: usize,
        /// What is wrong.
        reason: String,
    },
    /// A previous step failed; its stages were lost with the failing ranks.
    #[error("the trainer's stages were lost in an earlier failed step; start a new run")]
    Poisoned,
}

impl TrainError {
    /// Whether the step was refused as a whole and not applied — a non-finite global gradient
    /// norm, which every rank sees alike — so the trainer is intact and the next step may run
    /// (a caller may skip such a step, as mixed-precision loss scaling does).
    pub fn is_skipped_step(&self) -> bool {
        matches!(self, TrainError::Optim(OptimError::NonFiniteNorm { .. }))
    }
}

impl From<graphpp_comm::CommError> for TrainError {
    fn from(e: graphpp_comm::CommError) -> Self {
        TrainError::Comm(Box::new(e))
    }
}
