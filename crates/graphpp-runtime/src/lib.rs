//! graphpp-runtime (see ../../shared/DESIGN.md).
