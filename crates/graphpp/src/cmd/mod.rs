pub mod compare;
pub mod graph;
pub mod schedule;
pub mod verify;
