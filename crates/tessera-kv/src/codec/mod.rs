//! Codec arithmetic: how one vector becomes codes and back, independent of storage.

pub mod affine;
pub mod pairs;
pub(crate) mod prep;
pub mod turbo;
