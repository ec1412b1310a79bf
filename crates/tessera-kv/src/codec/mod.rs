//! Codec arithmetic: how one vector becomes codes and back, independent of storage.

pub mod affine;
pub(crate) mod prep;
pub mod turbo;
