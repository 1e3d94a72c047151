//! graphpp-schedule: the schedule IR of graphpp — actions and their text/CSV/JSON forms,
//! named generators, validation, lowering passes, simulation and timeline renderers.
//! No tensor library. See `docs/ARCHITECTURE.md`, "Schedule IR".

pub mod action;
pub mod bytes;
pub mod compare;
pub mod costs;
pub mod deps;
pub mod error_text;
pub mod generate;
pub mod lower;
pub mod measured;
pub mod placement;
pub mod render;
pub mod route;
pub mod schedule;
pub mod simulate;
mod table;
pub mod textfile;
pub mod timeline;
pub mod validate;

pub use action::{Action, ActionParseError, CommKind, ComputeKind, MicrobatchId, StageId, StageOpKind, Task};
pub use costs::{check_cost, CostError, CostProblem, Costs, Memory, MAX_COST};
pub use generate::{check_size, generate, GenerateError, Kind, Options, Shape, Solver, SolverError};
pub use lower::{lower, LowerError, LowerOptions};
pub use placement::Placement;
pub use schedule::{CsvError, CsvProblem, RankId, Schedule, ScheduleParseError, Step};
pub use simulate::{simulate, SimReport, SimulateError};
pub use timeline::{CommSpan, Interval, Timeline};
pub use validate::{validate, validated, Summary, ValidateOptions, Validated, ValidationError};
