//! graphpp-runtime: runs stage graphs and schedules — the graph executor on candle tensors,
//! the communicator between ranks, the device mesh, and the per-rank schedule
//! executor. See `docs/ARCHITECTURE.md`, "Runtime".

pub mod accumulate;
pub mod attention;
pub mod build;
pub mod clip;
pub mod comm;
pub mod data_parallel;
pub mod executor;
pub mod expf;
pub mod fusion;
pub mod lr;
pub mod malloc;
pub mod memory;
pub mod mesh;
pub mod optim;
pub mod pairs;
pub mod pipeline;
pub mod rank_train;
pub mod sample;
pub mod segment;
pub mod softmax;
pub mod stage;
pub mod threads;
mod tile8;
pub mod train;
pub mod transposed;
pub mod verify;

pub use clip::{clip_grad_norm, clip_scale, local_sq_norm, scale_grads};
pub use comm::{
    AllToAllOutput, Awaited, CollectiveOp, Comm, CommError, Group, Pending, PendingOp, Tag, TagKind,
    TensorDesc, ThreadComm,
};
pub use executor::{
    run, run_named, run_named_with, run_with, CollectiveError, ExecError, GraphComm, Program, RunOptions,
    RunReport,
};
pub use lr::{CosineSchedule, LrError};
pub use memory::{check_step, SizeError, StepMemory};
pub use mesh::{Coords, Mesh, MeshAxis, MeshError};
pub use optim::{AdamW, AdamWConfig, OptimError};
pub use pipeline::{run_pipeline, run_rank, PipelineError, RankOptions, RankOutcome, StageWork, WorkError};
pub use rank_train::{train_schedule, RankStepReport, RankTrainer};
pub use sample::{sample_next, SampleError};
pub use stage::{GraphStages, Microbatches, Stage, StageError};
pub use train::{StepReport, TrainError, TrainSetup, Trainer};
pub use verify::{verify_step, VerifyError, VerifyReport, VerifySetup};
