//! graphpp-schedule: the schedule IR of graphpp — actions and their text/CSV/JSON forms,
//! named generators, validation, lowering passes, simulation and timeline renderers.
//! No tensor library. See `shared/DESIGN.md`, "Schedule IR".

pub mod action;
pub mod schedule;

pub use action::{Action, ActionParseError, CommKind, ComputeKind, MicrobatchId, StageId, StageOpKind, Task};
pub use schedule::{CsvError, RankId, Schedule, Step};
