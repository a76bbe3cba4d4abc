//! sinks
