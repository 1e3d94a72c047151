//! graphpp-runtime (see `shared/DESIGN.md`, "Runtime"): the graph executor on candle tensors.
//! The stage and schedule executors build on [`executor`].

pub mod executor;

pub use executor::{run, run_named, run_with, Collectives, ExecError, RunOptions, RunReport, SingleRank};
