//! graphpp-graph: the tensor-program graph IR and its passes, with no tensor library
//! (see `docs/ARCHITECTURE.md`, "Graph IR").
//!
//! Pipeline of a stage's graphs: build the forward with [`builder::GraphBuilder`] and
//! [`layers`] → [`autodiff::autodiff`] (joint graph) → [`partition::partition`] (`fw`, `full_bw`,
//! saved values, recompute policy) → [`passes::split_di_dw`] (`bw_di`, `bw_dw`) →
//! [`passes::multiplex_fw_bw`] (overlap graphs) / [`passes::split_fsdp_collectives`].
//! [`stage_graphs`] runs the whole chain.

pub mod autodiff;
pub mod builder;
pub mod check;
pub mod dtype;
pub mod error;
pub mod extract;
pub mod graph;
pub mod infer;
pub mod layers;
pub mod names;
pub mod op;
pub mod partition;
pub mod passes;
pub mod print;
pub mod stage;

pub use builder::GraphBuilder;
pub use check::check_graph;
pub use dtype::{DType, Dims, TensorType, UnknownDType};
pub use error::{GraphError, Result};
pub use graph::{Graph, GraphOutput, InputSpec, Node, NodeMeta, Phase, Region, ValueId};
pub use op::{BinaryOp, CollectiveKind, CommGroup, InputKind, MeshAxis, Op, UnaryOp, UnknownMeshAxis};
pub use partition::{partition, FwBw, RecomputePolicy};
pub use stage::{stage_graphs, GraphKind, StageGraphs, UnknownGraphKind};
