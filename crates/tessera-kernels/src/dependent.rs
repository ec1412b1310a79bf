//! Programmatic dependent launches (Hopper): a kernel launched this way may be scheduled
//! while the kernel before it on the stream is still running, once every block of that one
//! has started (or has called `griddepcontrol.launch_dependents`). The kernel itself must
//! call `griddepcontrol.wait` before it reads anything an earlier kernel wrote, or writes
//! anything an earlier kernel may still read; what it does before (index math, loads of
//! constant weights) overlaps the previous kernel's tail. weights.cu's matmuls and their
//! input launches are written so. cudarc's launch builder has no launch attributes, hence
//! this one.

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, SyncOnDrop,
};
use std::ffi::c_void;

/// One launch's arguments, in order: scalars and device pointers held here in 8-byte slots
/// (a kernel reads an `int` or `float` parameter from its slot's first 4 bytes:
/// little-endian), structs borrowed from the caller; and the guards that record the slices'
/// use once the launch is queued.
pub(crate) struct DependentLaunch<'a> {
    stream: &'a CudaStream,
    slots: Vec<u64>,
    params: Vec<Param>,
    _guards: Vec<SyncOnDrop<'a>>,
}

/// Where a parameter's value is: a slot of [`DependentLaunch`], or a borrowed struct.
enum Param {
    Slot(usize),
    Value(*const c_void),
}

impl<'a> DependentLaunch<'a> {
    pub(crate) fn new(stream: &'a CudaStream) -> Self {
        DependentLaunch {
            stream,
            slots: Vec::with_capacity(16),
            params: Vec::with_capacity(16),
            _guards: Vec::with_capacity(8),
        }
    }

    fn slot(&mut self, v: u64) -> &mut Self {
        self.params.push(Param::Slot(self.slots.len()));
        self.slots.push(v);
        self
    }

    /// A device buffer the kernel reads.
    pub(crate) fn input<T>(&mut self, s: &'a impl DevicePtr<T>) -> &mut Self {
        let (ptr, guard) = s.device_ptr(self.stream);
        self._guards.push(guard);
        self.slot(ptr)
    }

    /// A device buffer the kernel writes.
    pub(crate) fn output<T>(&mut self, s: &'a mut impl DevicePtrMut<T>) -> &mut Self {
        let (ptr, guard) = s.device_ptr_mut(self.stream);
        self._guards.push(guard);
        self.slot(ptr)
    }

    pub(crate) fn int(&mut self, v: i32) -> &mut Self {
        self.slot(u64::from(v as u32))
    }

    pub(crate) fn long(&mut self, v: i64) -> &mut Self {
        self.slot(v as u64)
    }

    pub(crate) fn float(&mut self, v: f32) -> &mut Self {
        self.slot(u64::from(v.to_bits()))
    }

    /// A parameter passed by value as it is laid out in `v` (a `#[repr(C)]` struct).
    pub(crate) fn value<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        let at: *const T = v;
        self.params.push(Param::Value(at.cast()));
        self
    }

    /// Queues `f` on the stream with programmatic stream serialization allowed.
    ///
    /// # Safety
    /// The arguments must be the kernel's parameters, in order and of its types, and the
    /// kernel must wait (`griddepcontrol.wait`) before touching what earlier kernels write
    /// or read; the buffers must hold what the kernel indexes.
    pub(crate) unsafe fn launch(
        mut self,
        f: &CudaFunction,
        cfg: LaunchConfig,
    ) -> anyhow::Result<()> {
        self.stream.context().bind_to_thread()?;
        // The slots no longer move: their addresses are taken now.
        let slots = self.slots.as_mut_ptr();
        let mut params: Vec<*mut c_void> = self
            .params
            .iter()
            .map(|p| match *p {
                Param::Slot(i) => slots.add(i).cast(),
                Param::Value(v) => v.cast_mut(),
            })
            .collect();
        // SAFETY: an all-zero attribute is valid (a zero value of every union member); the id
        // and the one member it selects are set next.
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: params point at slots and borrowed values that outlive the call (the driver
        // copies them).
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()?;
        Ok(())
    }
}
