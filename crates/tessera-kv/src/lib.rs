//! tessera-kv: per-layer KV storage and the attention reads over it.
//!
//! A model's attention layer appends its new keys and values to a [`LayerCache`] and gets
//! back an [`AttentionRead`] to attend with; it never sees how positions are stored.
//! A layer cache composes four separate concerns, following the reference design's
//! KV "legos" (`../shared/seeds/`):
//!
//! - **Codec** ([`Codec`]) — how a position is encoded into tensor planes
//!   `[row, kv_head, slot, field]`. This first slice has [`Codec::Plain`] (bf16, f16, f32),
//!   stored by [`plain::PlainPlanes`].
//! - **Retention** ([`Retention`]) — which positions are kept and in which slot:
//!   `Full` (capacity grows in 256-slot steps) or `Window` (a ring of `size` slots).
//! - **Rows** ([`rows::Rows`]) — batch bookkeeping: per-row left padding and offsets, masks.
//! - **Composition** ([`KvScheme`]) — which codec each layer gets, parsed from `--kv SCHEME`.
//!
//! [`KvCache`] holds one [`LayerCache`] per model layer, built from the model's
//! [`LayerSpec`]s and a [`KvScheme`].

mod cache;
pub mod codec;
mod error;
mod isa;
mod layer;
mod live;
pub mod planes;
mod read;
mod relayout;
mod retention;
mod rewind;
pub mod rows;
mod scheme;
mod state;
mod transition;

pub use cache::{sliding_notice, KvCache};
pub use codec::prep::QueryMoments;
pub use error::KvError;
pub use isa::Isa;
pub use layer::{AttentionCache, DonorRows, LayerCache};
pub use read::{exp_nonpositive, AttentionRead};
pub use scheme::{Codec, KvScheme, LayerSpec, PlainDType, Retention, TurboPrep};
pub use state::{CacheState, LayerState, STATE_VERSION};
pub use transition::{FIRST_APPEND, NEVER_REUSED};

/// The most slots a layer's planes may hold per row (a restored state claiming more is
/// refused): far past any model's context.
pub const MAX_CAPACITY: usize = 1 << 24;

/// Capacity of full-retention storage grows in steps of this many positions, so that
/// appends do not reallocate the whole cache every token.
pub const GROWTH_STEP: usize = 256;

/// The capacity that holds `slots`: the next [`GROWTH_STEP`] multiple, capped at `limit`
/// (a ring's size) but never below `slots`.
pub fn grown_capacity(slots: usize, limit: usize) -> usize {
    (slots.div_ceil(GROWTH_STEP) * GROWTH_STEP)
        .min(limit)
        .max(slots)
}

/// Asks the C allocator to keep freed memory for reuse (glibc only; elsewhere a no-op), for
/// a binary to call once at start. Row operations build planes of many MiB; glibc hands
/// blocks that large back to the kernel when they are freed, so each merge or filter would
/// fault every 4 KiB page of its new planes in again — measured at more than the copy itself
/// (BENCHMARKS.md, "Cache rows"). Returns whether the allocator took the settings.
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is called before the
        // blocks it affects exist, and its arguments are within glibc's documented ranges.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
