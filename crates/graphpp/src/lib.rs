//! The `graphpp` command-line crate's library part: data, tokenizer and checkpoint handling used by
//! the binary (DESIGN.md, "Workspace layout": the CLI crate holds data, tokenizer, checkpoints).

pub mod checkpoint;
pub mod data;
pub mod pretrained;
pub mod train;
