//! graphpp-graph (see ../../shared/DESIGN.md).
