//! TODO(generator): not implemented yet.

use super::{GenerateError, Kind, Shape};
use crate::schedule::Schedule;

/// Not implemented yet.
pub fn generate(shape: &Shape) -> Result<Schedule, GenerateError> {
    Err(GenerateError::constraint(Kind::InterleavedZb, shape, "not implemented yet"))
}
