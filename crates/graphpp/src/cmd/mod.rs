pub mod compare;
pub mod schedule;
pub mod verify;
