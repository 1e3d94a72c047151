//! TODO(generator): not implemented yet.

use super::{GenerateError, Kind, Shape};
use crate::schedule::Schedule;

/// Not implemented yet.
pub fn generate_dualpipe(shape: &Shape) -> Result<Schedule, GenerateError> {
    Err(GenerateError::constraint(Kind::DualPipe, shape, "not implemented yet"))
}

/// Not implemented yet.
pub fn generate_dualpipev(shape: &Shape) -> Result<Schedule, GenerateError> {
    Err(GenerateError::constraint(Kind::DualPipeV, shape, "not implemented yet"))
}
