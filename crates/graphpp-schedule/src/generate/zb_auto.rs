//! TODO(generator): not implemented yet.

use super::{GenerateError, Kind, Options, Shape};
use crate::schedule::Schedule;

/// Not implemented yet.
pub fn generate(shape: &Shape, _opts: &Options) -> Result<Schedule, GenerateError> {
    Err(GenerateError::constraint(Kind::ZbAuto, shape, "not implemented yet"))
}
