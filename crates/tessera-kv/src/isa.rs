//! The CPU's vector instruction level, as one value the kernels are handed.
//!
//! Every kernel with paths per instruction set (the decode tiles, affine unpacking, turbo
//! decoding, the Q8 matmul, exp and gelu) takes an [`Isa`] instead of asking the CPU itself,
//! so a caller can cap the level (`tessera --isa avx2`, a test looping over
//! [`Isa::supported`]) and the portable and AVX2 paths run on an AVX-512 machine too.

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
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni];

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

    /// Parses `portable`, `avx2`, `avx512` or `avx512vnni` (as `tessera --isa` takes them).
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
    if has!("avx512vnni") {
        Isa::Avx512Vnni
    } else {
        Isa::Avx512
    }
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
    }
}
