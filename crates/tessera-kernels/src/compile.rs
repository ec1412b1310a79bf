//! Our CUDA sources compiled at run time by NVRTC and loaded into a context.
//!
//! NVRTC compiles for the H100 / H200 (`sm_90`). Asked for a real architecture, it runs the
//! whole toolchain, PTX and then the device code (ptxas), so on an sm_90 device the module is
//! loaded from that device code (the cubin) as it is. Loading the PTX instead, as we did
//! before, threw that work away and had the driver compile the PTX again: weights.cu is
//! ≈ 1.4 s of NVRTC to PTX and as much again of ptxas on a 2-core host. Other devices get the
//! PTX, which the driver compiles for them.
//!
//! A fresh machine's first process pays for every module it compiles; the driver's disk
//! cache (`CUDA_CACHE_PATH`, on by default) spares later processes. [`compile_time`] is what
//! this process has spent, for the CLI's summary.

use anyhow::{anyhow, Result};
use candle_core::cuda_backend::cudarc;
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{result, sys, Ptx};
use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The architecture NVRTC compiles for.
const ARCH: &str = "sm_90";
/// The compute capability whose devices load [`ARCH`]'s device code.
const ARCH_CAPABILITY: (i32, i32) = (9, 0);

static COMPILE_NANOS: AtomicU64 = AtomicU64::new(0);

/// The time this process has spent compiling and loading our modules.
pub fn compile_time() -> Duration {
    Duration::from_nanos(COMPILE_NANOS.load(Ordering::Relaxed))
}

/// What NVRTC made of a source.
pub struct Compiled {
    pub ptx: Vec<u8>,
    /// The device code for [`ARCH`].
    pub cubin: Vec<u8>,
}

/// `src` compiled by NVRTC for sm_90, PTX and device code. Needs no device: kernels-compile
/// runs it on a machine without one.
pub fn compile(src: &str) -> Result<Compiled> {
    let src = CString::new(src).map_err(|_| anyhow!("NVRTC: the source holds a NUL byte"))?;
    let program = Program(result::create_program(&src, None).map_err(nvrtc_error)?);
    let options = [format!("--gpu-architecture={ARCH}")];
    // SAFETY: `program` was created above and is destroyed only when it drops.
    if let Err(e) = unsafe { result::compile_program(program.0, &options) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(program.0) }
            .ok()
            .map(|log| {
                // SAFETY: NVRTC's log is a NUL-terminated string.
                unsafe { CStr::from_ptr(log.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        return Err(anyhow!("NVRTC ({e:?}):\n{log}"));
    }
    // SAFETY: as above; a compiled program has its PTX.
    let ptx = unsafe { result::get_ptx(program.0) }.map_err(nvrtc_error)?;
    let mut size = 0usize;
    // SAFETY: as above, and `size` outlives the call.
    unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }
        .result()
        .map_err(nvrtc_error)?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds the `size` bytes NVRTC reported for this program.
    unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(nvrtc_error)?;
    Ok(Compiled {
        ptx: ptx.into_iter().map(|c| c as u8).collect(),
        cubin,
    })
}

/// `src` compiled and loaded into `ctx`: the device code on an sm_90 device, else the PTX.
pub fn load(ctx: &Arc<CudaContext>, src: &str) -> Result<Arc<CudaModule>> {
    let start = Instant::now();
    let compiled = compile(src)?;
    let image = if ctx.compute_capability()? == ARCH_CAPABILITY {
        compiled.cubin
    } else {
        // NUL-terminated, as the driver reads a PTX image.
        compiled.ptx
    };
    let module = ctx.load_module(Ptx::from_binary(image))?;
    let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    COMPILE_NANOS.fetch_add(nanos, Ordering::Relaxed);
    Ok(module)
}

fn nvrtc_error(e: result::NvrtcError) -> anyhow::Error {
    anyhow!("NVRTC: {e:?}")
}

/// Destroys its program when dropped, on every path out of [`compile`].
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed only here. A
        // failure leaves nothing to do.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}
