//! Typed errors of the graph crate: each names the node (id and scope) and the problem.

use thiserror::Error;

/// Errors from building, verifying or transforming a graph.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum GraphError {
    /// An op got operands whose types it cannot accept.
    #[error("shape error in {op} at {at}: {reason}")]
    Shape {
        /// Op mnemonic.
        op: String,
        /// Where: `%id (scope)` or the scope being built.
        at: String,
        /// What is wrong.
        reason: String,
    },
    /// A structural invariant does not hold ([`crate::check_graph`]).
    #[error("graph `{graph}` is malformed at {at}: {reason}")]
    Malformed {
        /// Graph name.
        graph: String,
        /// Node or output concerned.
        at: String,
        /// What is wrong.
        reason: String,
    },
    /// A pass was asked for something the graph cannot give.
    #[error("pass {pass} on graph `{graph}`: {reason}")]
    Pass {
        /// Pass name.
        pass: String,
        /// Graph name.
        graph: String,
        /// What is wrong.
        reason: String,
    },
    /// Autodiff met a construct it has no rule for.
    #[error("autodiff at {at}: {reason}")]
    Autodiff {
        /// Node concerned.
        at: String,
        /// What is wrong.
        reason: String,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, GraphError>;
