//! Codec arithmetic: how one vector becomes codes and back, independent of storage.

pub mod affine;
pub mod pairs;
pub mod prep;
pub mod turbo;
