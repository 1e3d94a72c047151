//! TODO(generator): not implemented yet.

use super::{GenerateError, Kind, Shape};
use crate::schedule::Schedule;

/// Not implemented yet.
pub fn generate_h1(shape: &Shape) -> Result<Schedule, GenerateError> {
    Err(GenerateError::constraint(Kind::ZbH1, shape, "not implemented yet"))
}

/// Not implemented yet.
pub fn generate_h2(shape: &Shape) -> Result<Schedule, GenerateError> {
    Err(GenerateError::constraint(Kind::ZbH2, shape, "not implemented yet"))
}
