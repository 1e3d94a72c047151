//! graphpp-runtime: runs stage graphs and schedules — transports between ranks, the per-rank
//! schedule executor, and (on candle tensors) the graph executor. See `shared/DESIGN.md`, "Runtime".

pub mod transport;

pub use transport::{Tag, TagKind, ThreadTransport, Transport, TransportError};
pub mod pipeline;

pub use pipeline::{run_pipeline, PipelineError, StageWork, WorkError};
