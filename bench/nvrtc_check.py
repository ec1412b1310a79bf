"""Compiles decode.cu with NVRTC here (no GPU needed) for the given configurations, the way
the engine does on the device: catches what nvcc forgives (NVRTC has no CUDA headers).
  eval "$(bash ../shared/gpu/setup-cuda-toolkit.sh | grep ^export)"
  LD_LIBRARY_PATH=$CUDA_HOME/lib python3 bench/nvrtc_check.py crates/tessera-kernels/src/decode.cu 4,128,4 0,128,8
Each configuration is CODEC,D,G[,GROUP] (CODEC 0 = bf16, 4/8 = affine bits; group 64 unless
given); TESSERA_KERNEL_DEFINES adds #define lines as on the device."""
import ctypes, sys, os
lib = ctypes.CDLL(os.path.join(os.environ["CUDA_HOME"], "lib", "libnvrtc.so.13"))
src = open(sys.argv[1]).read()
for cfg in sys.argv[2:]:
    c, d, g, *grp = cfg.split(",")
    extra = os.environ.get("TESSERA_KERNEL_DEFINES", "")
    full = f"#define CODEC {c}\n#define D {d}\n#define G {g}\n#define GROUP {grp[0] if grp else 64}\n{extra}\n" + src
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), full.encode(), b"k.cu", 0, None, None) == 0
    opts = (ctypes.c_char_p * 1)(b"--gpu-architecture=sm_90")
    rc = lib.nvrtcCompileProgram(prog, 1, opts)
    n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log)
    print(cfg, "rc", rc, log.value.decode()[:3000])
