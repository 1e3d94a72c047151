//! graphpp-models (see ../../shared/DESIGN.md).
