//! The `Plain` codec: keys and values stored unquantized in bf16, f16 or f32, in planes
//! `(rows, kv_heads, slots, head_dim)`, as mlx-lm's `KVCache` stores them.

use crate::{KvError, PlainDType};
use candle_core::{DType, Device, Tensor};

/// Storage planes of one layer. Slots are addressed by the retention policy; this type
/// only writes and reads contiguous slot ranges.
#[derive(Debug)]
pub struct PlainPlanes {
    dtype: PlainDType,
    keys: Option<Tensor>,
    values: Option<Tensor>,
}

impl PlainPlanes {
    pub fn new(dtype: PlainDType) -> Self {
        PlainPlanes {
            dtype,
            keys: None,
            values: None,
        }
    }

    pub fn dtype(&self) -> PlainDType {
        self.dtype
    }

    pub fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.dims()[2])
    }

    /// Allocated bytes of both planes.
    pub fn allocated_bytes(&self) -> usize {
        [&self.keys, &self.values]
            .iter()
            .filter_map(|t| t.as_ref())
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// Rounds `input` to the storage dtype and back to f32: exactly what a later read of
    /// the stored position returns.
    pub fn as_stored(&self, input: &Tensor) -> Result<Tensor, KvError> {
        Ok(input.to_dtype(self.dtype.dtype())?.to_dtype(DType::F32)?)
    }

    /// Makes room for at least `slots` slots, growing in [`crate::GROWTH_STEP`] steps but never past
    /// `limit`. Existing slots keep their contents.
    pub fn reserve(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        slots: usize,
        limit: usize,
    ) -> Result<(), KvError> {
        if slots <= self.capacity() {
            return Ok(());
        }
        let capacity = crate::grown_capacity(slots, limit);
        let grow = |old: &Option<Tensor>, like: &Tensor| -> Result<Tensor, KvError> {
            let (b, h, _, d) = like.dims4()?;
            let fresh = Tensor::zeros((b, h, capacity, d), self.dtype.dtype(), like.device())?;
            if let Some(old) = old {
                fresh.slice_set(old, 2, 0)?;
            }
            Ok(fresh)
        };
        let keys = grow(&self.keys, k)?;
        let values = grow(&self.values, v)?;
        self.keys = Some(keys);
        self.values = Some(values);
        Ok(())
    }

    /// Writes `k`, `v` `(rows, kv_heads, n, dim)` into slots `slot .. slot + n`.
    pub fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(), KvError> {
        let dtype = self.dtype.dtype();
        let (keys, values) = (
            self.keys.as_ref().expect("reserved"),
            self.values.as_ref().expect("reserved"),
        );
        keys.slice_set(&k.to_dtype(dtype)?.contiguous()?, 2, slot)?;
        values.slice_set(&v.to_dtype(dtype)?.contiguous()?, 2, slot)?;
        Ok(())
    }

    /// Slots `slot .. slot + len` of both planes, as f32.
    pub fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor), KvError> {
        let (keys, values) = (
            self.keys.as_ref().expect("reserved"),
            self.values.as_ref().expect("reserved"),
        );
        Ok((
            keys.narrow(2, slot, len)?
                .to_dtype(DType::F32)?
                .contiguous()?,
            values
                .narrow(2, slot, len)?
                .to_dtype(DType::F32)?
                .contiguous()?,
        ))
    }

    /// The stored planes `(rows, kv_heads, capacity, dim)`, for fused reads.
    pub fn planes(&self) -> (&Tensor, &Tensor) {
        (
            self.keys.as_ref().expect("reserved"),
            self.values.as_ref().expect("reserved"),
        )
    }

    pub fn device(&self) -> Device {
        self.keys
            .as_ref()
            .map_or(Device::Cpu, |k| k.device().clone())
    }
}
