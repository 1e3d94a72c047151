//! The `graphpp` command-line crate's library part: data, tokenizer, checkpoint handling and the run
//! report used by the binary (docs/ARCHITECTURE.md, "Workspace layout": the CLI crate holds data, tokenizer, checkpoints).

pub mod checkpoint;
pub mod dag;
pub mod data;
pub mod export;
pub mod fit;
pub mod hardware;
pub mod launch;
pub mod metrics;
pub mod plan;
pub mod pretrained;
pub mod profile;
pub mod report;
pub mod stop;
pub mod strategy;
/// Bounded reads of text inputs (kept in `graphpp-schedule`, which reads schedule files too).
pub use graphpp_schedule::textfile;
pub mod train;
