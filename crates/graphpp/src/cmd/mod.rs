pub mod compare;
pub mod schedule;
