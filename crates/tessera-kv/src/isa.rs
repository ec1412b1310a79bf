//! The CPU's vector instruction level, as one value the kernels are handed.
//!
//! Every kernel with paths per instruction set (the decode tiles, affine unpacking, turbo
//! decoding, the Q8 matmul, exp and gelu) takes an [`Isa`] instead of asking the CPU itself,
//! so a caller can cap the level (`tessera --isa avx2`, a test looping over
//! [`Isa::supported`]) and the portable and AVX2 paths run on an AVX-512 machine too.
//! The top level, [`Isa::Amx`], adds Intel's AMX int8 tile unit (not a vector extension,
//! but it sits above AVX-512 VNNI on every CPU that has it, and capping below it must
//! switch it off like the others).

use std::fmt;
use std::sync::OnceLock;

/// Vector instruction levels, each including the ones below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust loops (whatever the compiler's baseline target gives): every CPU.
    Portable,
    /// AVX2 with FMA and F16C (x86-64-v3).
    Avx2,
    /// AVX-512 F, BW, VL and DQ on top of AVX2.
    Avx512,
    /// AVX-512 with VNNI (int8 dot products).
    Avx512Vnni,
    /// AVX-512 VNNI plus AMX tiles with int8 products (`tdpbssd`), which the OS let this
    /// process use (on Linux, a granted `arch_prctl` request for the tile data state).
    Amx,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 5] = [
        Isa::Portable,
        Isa::Avx2,
        Isa::Avx512,
        Isa::Avx512Vnni,
        Isa::Amx,
    ];

    /// The highest level this CPU runs, detected once per process.
    pub fn detected() -> Isa {
        static LEVEL: OnceLock<Isa> = OnceLock::new();
        *LEVEL.get_or_init(detect)
    }

    /// Every level this CPU runs, lowest first: what a test loops over.
    pub fn supported() -> Vec<Isa> {
        let top = Isa::detected();
        Isa::ALL.into_iter().filter(|l| *l <= top).collect()
    }

    /// `self`, lowered to what this CPU runs.
    pub fn capped(self) -> Isa {
        self.min(Isa::detected())
    }

    pub fn avx2(self) -> bool {
        self >= Isa::Avx2
    }

    pub fn avx512(self) -> bool {
        self >= Isa::Avx512
    }

    pub fn vnni(self) -> bool {
        self >= Isa::Avx512Vnni
    }

    pub fn amx(self) -> bool {
        self >= Isa::Amx
    }

    /// Parses `portable`, `avx2`, `avx512`, `avx512vnni` or `amx` (as `tessera --isa`
    /// takes them).
    pub fn parse(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|l| l.to_string() == name)
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Amx => "amx",
        })
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    use std::is_x86_feature_detected as has;
    if !(has!("avx2") && has!("fma") && has!("f16c")) {
        return Isa::Portable;
    }
    if !(has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq")) {
        return Isa::Avx2;
    }
    if !has!("avx512vnni") {
        return Isa::Avx512;
    }
    if amx_granted() {
        Isa::Amx
    } else {
        Isa::Avx512Vnni
    }
}

/// Whether the CPU has AMX tiles with int8 products and the OS grants their state to this
/// process. Linux keeps the 8 KiB tile data out of a thread's saved state until the process
/// asks for it; a tile instruction before that faults. The permission is per process, and
/// [`Isa::detected`] asks once.
#[cfg(target_arch = "x86_64")]
fn amx_granted() -> bool {
    // CPUID leaf 7, sub-leaf 0: EDX bit 24 AMX-TILE, bit 25 AMX-INT8 (std's feature
    // detection does not know AMX on stable). The caller checked AVX-512, so leaf 7 exists.
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    if edx & (1 << 24) == 0 || edx & (1 << 25) == 0 {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only records a permission for this
        // process; it reads and writes no memory of ours. A kernel without AMX support
        // refuses it (nonzero), and AMX stays off.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }
    #[cfg(not(target_os = "linux"))]
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Portable
}

#[cfg(test)]
mod tests {
    use super::Isa;

    #[test]
    fn levels_order_parse_and_cap() {
        let supported = Isa::supported();
        assert_eq!(supported[0], Isa::Portable);
        assert_eq!(*supported.last().unwrap(), Isa::detected());
        for level in Isa::ALL {
            assert_eq!(Isa::parse(&level.to_string()), Some(level));
            assert!(level.capped() <= Isa::detected());
        }
        assert_eq!(Isa::parse("sse2"), None);
        assert!(Isa::Avx512Vnni.avx512() && Isa::Avx512.avx2() && !Isa::Avx2.avx512());
        assert!(Isa::Amx.vnni() && Isa::Amx.amx() && !Isa::Avx512Vnni.amx());
        assert_eq!(Isa::parse("amx"), Some(Isa::Amx));
        // AMX is detected only where the CPU reports AMX-TILE and AMX-INT8 (with them,
        // the OS may still refuse the tile state, and the level stays AVX-512 VNNI).
        #[cfg(target_arch = "x86_64")]
        if Isa::detected() == Isa::Amx {
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            assert_eq!(edx >> 24 & 3, 3);
        }
    }
}
