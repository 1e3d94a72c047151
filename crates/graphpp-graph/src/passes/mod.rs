//! Graph passes (docs/ARCHITECTURE.md "Graph IR"): each output passes [`crate::check_graph`].

pub mod dce;
pub mod fsdp;
pub mod multiplex;
pub mod split_di_dw;

pub use dce::dce;
pub use fsdp::{split_fsdp_collectives, unsharded, FsdpSplit};
pub use multiplex::{is_comm, multiplex_fw_bw, Multiplex};
pub use split_di_dw::{split_di_dw, DiDw};
