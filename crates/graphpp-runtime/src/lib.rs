//! graphpp-runtime: runs stage graphs under schedules, one rank at a time, over a
//! [`graphpp_comm::Comm`] (docs/ARCHITECTURE.md, "Runtime").
//!
//! The modules are layers; each imports only the ones listed before it:
//!
//! 1. [`kernels`]: CPU math on tensors and slices (matmul, softmax, attention, accumulation,
//!    routing), the rank's thread pool;
//! 2. [`exec`]: runs one graph — the interpreter, the compiled [`Program`] (fusion, liveness),
//!    the graph's collectives;
//! 3. [`optim`]: AdamW, gradient clipping, the learning-rate schedule;
//! 4. [`pipeline`]: one rank's lowered schedule ([`run_rank`]), its stages and data-parallel
//!    reductions;
//! 5. [`train`]: a training run — building a rank's stages, size estimates, [`RankTrainer`],
//!    [`Trainer`];
//! 6. [`verify`]: a pipelined step against the same step on one device; imported by nothing.
//!
//! [`malloc`] (the process's allocator) stands apart: binaries read it, nothing here imports it.

pub mod exec;
pub mod kernels;
pub mod malloc;
pub mod optim;
pub mod pipeline;
pub mod train;
pub mod verify;

pub use exec::{
    run, run_named, run_named_with, run_with, CollectiveError, ExecError, ExecReport, GraphComm, Program,
    RunOptions,
};
pub use optim::clip::{clip_grad_norm, clip_scale, local_sq_norm, scale_grads};
pub use optim::lr::{CosineSchedule, LrError};
pub use optim::{AdamW, AdamWConfig, OptimError};
pub use pipeline::stage::{GraphStages, Microbatches, Stage, StageError};
pub use pipeline::{run_pipeline, run_rank, PipelineError, RankOptions, RankOutcome, StageWork, WorkError};
pub use train::error::SetupError;
pub use train::memory::{check_step, Layout as MemoryLayout, SizeError, StepMemory};
pub use train::rank_train::{RankStepReport, RankTrainer, StepStats};
pub use train::sample::{sample_next, SampleError};
pub use train::{StepReport, TrainError, TrainSetup, Trainer};
pub use verify::{verify_step, VerifyError, VerifyReport, VerifySetup};
