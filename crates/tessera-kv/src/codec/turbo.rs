//! The TurboQuant codec's arithmetic (arXiv 2504.19874, written from the paper): a vector is
//! stored as its norm plus the codes of its normalized, randomly rotated coordinates.
//!
//! - **Rotation**: a randomized Hadamard transform — multiply by seeded random signs, then a
//!   fast Walsh–Hadamard transform scaled by 1/√d. Orthonormal, O(d log d), nothing stored
//!   but the seed; its inverse is the same transform followed by the signs.
//! - **Codebooks**: after a random rotation, each coordinate of a unit vector in d dimensions
//!   has density ∝ (1 − x²)^((d−3)/2) on [−1, 1] (≈ N(0, 1/d)). The codebook for `bits` is
//!   the Lloyd–Max quantizer of that density, computed here by Lloyd's iteration on a fine
//!   grid: thresholds at the midpoints of neighbouring levels, levels at the conditional
//!   means of their cells.
//!
//! This module is the codec's arithmetic only; storage and reads build on it.

/// A seeded randomized Hadamard rotation of `dim`-element vectors (`dim` a power of two).
#[derive(Debug, Clone)]
pub struct Rotation {
    signs: Vec<f32>,
}

/// splitmix64: a tiny, well-mixed generator, so the rotation depends on the seed only.
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// In-place fast Walsh–Hadamard transform, unnormalized.
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (s, t) = (*u + *v, *u - *v);
                *u = s;
                *v = t;
            }
        }
        h *= 2;
    }
}

impl Rotation {
    /// The rotation of `dim` elements for `seed`. `dim` must be a power of two.
    pub fn new(dim: usize, seed: u64) -> Self {
        assert!(
            dim.is_power_of_two(),
            "Hadamard rotation needs a power-of-two dim"
        );
        let mut state = seed;
        let signs = (0..dim)
            .map(|_| {
                if splitmix64(&mut state) & 1 == 0 {
                    1.0
                } else {
                    -1.0
                }
            })
            .collect();
        Rotation { signs }
    }

    pub fn dim(&self) -> usize {
        self.signs.len()
    }

    /// The ±1 signs applied before the transform (a device backend's copy of the rotation).
    pub fn signs(&self) -> &[f32] {
        &self.signs
    }

    /// `x ← H · diag(signs) · x / √d`.
    pub fn forward(&self, x: &mut [f32]) {
        for (v, s) in x.iter_mut().zip(&self.signs) {
            *v *= s;
        }
        fwht(x);
        let norm = 1.0 / (x.len() as f32).sqrt();
        x.iter_mut().for_each(|v| *v *= norm);
    }

    /// The inverse: `x ← diag(signs) · H · x / √d` (H is symmetric and H² = d·I).
    pub fn inverse(&self, x: &mut [f32]) {
        fwht(x);
        let norm = 1.0 / (x.len() as f32).sqrt();
        for (v, s) in x.iter_mut().zip(&self.signs) {
            *v *= s * norm;
        }
    }
}

/// A scalar quantizer: `levels` in increasing order and the `thresholds` between them.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    pub levels: Vec<f32>,
    pub thresholds: Vec<f32>,
}

/// Points and normalized weights of the coordinate density of a random unit vector in `dim`
/// dimensions, on a grid fine enough for 8-bit codebooks.
fn coordinate_density(dim: usize) -> (Vec<f64>, Vec<f64>) {
    // The density is negligible beyond 12 standard deviations (σ ≈ 1/√d).
    let reach = (12.0 / (dim as f64).sqrt()).min(1.0);
    let n = 1 << 16;
    let step = 2.0 * reach / n as f64;
    let exponent = (dim as f64 - 3.0) / 2.0;
    let xs: Vec<f64> = (0..n).map(|i| -reach + (i as f64 + 0.5) * step).collect();
    let mut ws: Vec<f64> = xs
        .iter()
        .map(|x| (1.0 - x * x).max(0.0).powf(exponent))
        .collect();
    let total: f64 = ws.iter().sum();
    ws.iter_mut().for_each(|w| *w /= total);
    (xs, ws)
}

impl Codebook {
    /// The Lloyd–Max codebook of `bits` bits for coordinates of rotated unit vectors of
    /// `dim` dimensions.
    pub fn lloyd_max(dim: usize, bits: u8) -> Self {
        let (xs, ws) = coordinate_density(dim);
        let k = 1usize << bits;
        // Start from the high-rate optimum: cells of equal mass under density^(1/3) (the
        // compander of Panter and Dite). Lloyd's iteration moves a codebook only slowly, so
        // its start decides what 300 iterations reach: from equal-probability cells the
        // 8-bit book ended 2.8× above the optimum's squared error (6 bits 18%, 7 bits 75%).
        let cube: Vec<f64> = ws.iter().map(|w| w.cbrt()).collect();
        let cube_total: f64 = cube.iter().sum();
        let mut levels = Vec::with_capacity(k);
        let (mut acc, mut cell, mut mass, mut moment) = (0.0, 0usize, 0.0, 0.0);
        for ((x, w), c) in xs.iter().zip(&ws).zip(&cube) {
            acc += c / cube_total;
            mass += w;
            moment += w * x;
            if acc >= (cell + 1) as f64 / k as f64 && cell + 1 < k {
                levels.push(if mass > 0.0 { moment / mass } else { *x });
                (cell, mass, moment) = (cell + 1, 0.0, 0.0);
            }
        }
        levels.push(moment / mass.max(f64::MIN_POSITIVE));
        for _ in 0..300 {
            let thresholds: Vec<f64> = levels.windows(2).map(|p| (p[0] + p[1]) / 2.0).collect();
            let (mut mass, mut moment) = (vec![0.0; k], vec![0.0; k]);
            let mut c = 0;
            for (x, w) in xs.iter().zip(&ws) {
                while c < k - 1 && *x > thresholds[c] {
                    c += 1;
                }
                mass[c] += w;
                moment[c] += w * x;
            }
            for c in 0..k {
                if mass[c] > 0.0 {
                    levels[c] = moment[c] / mass[c];
                }
            }
        }
        let thresholds = levels
            .windows(2)
            .map(|p| ((p[0] + p[1]) / 2.0) as f32)
            .collect();
        Codebook {
            levels: levels.iter().map(|&l| l as f32).collect(),
            thresholds,
        }
    }

    /// [`Codebook::lloyd_max`], computed once per `(dim, bits)` for the whole process.
    pub fn shared(dim: usize, bits: u8) -> Codebook {
        // A panic elsewhere while the lock is held cannot leave the map half-written (books
        // are computed outside it, inserted whole), so a poisoned lock is taken as is rather
        // than failing every later cache of the process.
        let books = || shared_books().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(book) = books().get(&(dim, bits)) {
            return book.clone();
        }
        let book = Codebook::lloyd_max(dim, bits);
        books().insert((dim, bits), book.clone());
        book
    }

    /// The code of `x`: the index of its cell.
    #[inline]
    pub fn encode(&self, x: f32) -> u8 {
        self.thresholds.partition_point(|&t| t < x) as u8
    }

    #[inline]
    pub fn decode(&self, code: u8) -> f32 {
        self.levels[code as usize]
    }

    /// Expected squared error of one coordinate of a rotated unit vector in `dim` dimensions.
    pub fn coordinate_mse(&self, dim: usize) -> f64 {
        let (xs, ws) = coordinate_density(dim);
        xs.iter()
            .zip(&ws)
            .map(|(&x, &w)| {
                let q = self.decode(self.encode(x as f32)) as f64;
                w * (x - q) * (x - q)
            })
            .sum()
    }
}

type Books = std::sync::Mutex<std::collections::HashMap<(usize, u8), Codebook>>;

/// The process-wide cache behind [`Codebook::shared`].
fn shared_books() -> &'static Books {
    static BOOKS: std::sync::OnceLock<Books> = std::sync::OnceLock::new();
    BOOKS.get_or_init(Books::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_while_the_codebook_cache_is_held_does_not_break_it() {
        let before = Codebook::shared(64, 2);
        // A thread that panics while holding the lock poisons it.
        let poisoner = std::thread::spawn(|| {
            let _held = shared_books().lock().unwrap();
            panic!("poisoning the codebook cache on purpose");
        });
        assert!(poisoner.join().is_err());
        assert!(shared_books().is_poisoned());
        // Cached and new books are still served.
        assert_eq!(Codebook::shared(64, 2).levels, before.levels);
        let fresh = Codebook::shared(48, 3);
        assert_eq!(fresh.levels, Codebook::lloyd_max(48, 3).levels);
    }

    #[test]
    fn rotation_is_orthonormal_and_inverts() {
        let rot = Rotation::new(256, 7);
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let mut y = x.clone();
        rot.forward(&mut y);
        let norm = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        assert!((norm(&x) - norm(&y)).abs() < 1e-4 * norm(&x));
        assert!(
            x.iter().zip(&y).any(|(a, b)| (a - b).abs() > 1e-3),
            "rotation moved x"
        );
        rot.inverse(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // The seed alone decides the rotation.
        assert_eq!(Rotation::new(256, 7).signs, rot.signs);
        assert_ne!(Rotation::new(256, 8).signs, rot.signs);
    }

    /// The paper's distortion for unit vectors (total MSE over all coordinates): 0.36, 0.117,
    /// 0.034, 0.0094 at 1–4 bits, within 5%.
    #[test]
    fn codebooks_reach_the_papers_distortion() {
        for dim in [64, 128, 256] {
            for (bits, paper) in [(1u8, 0.36), (2, 0.117), (3, 0.034), (4, 0.0094)] {
                let book = Codebook::lloyd_max(dim, bits);
                let mse = book.coordinate_mse(dim) * dim as f64;
                assert!(
                    (mse - paper).abs() <= 0.05 * paper,
                    "dim {dim} bits {bits}: {mse} vs the paper's {paper}"
                );
            }
        }
    }

    /// At 5–8 bits the codebooks sit at the high-rate optimum (Panter–Dite: total squared
    /// error π√3/2 · 2^(−2·bits) for a unit vector, the coordinates ≈ N(0, 1/d)), which the
    /// best scalar quantizer approaches from below as bits grow.
    #[test]
    fn wide_codebooks_reach_the_high_rate_optimum() {
        for dim in [64, 256] {
            for bits in 5u8..=8 {
                let book = Codebook::lloyd_max(dim, bits);
                let mse = book.coordinate_mse(dim) * dim as f64;
                let bound = std::f64::consts::PI * 3f64.sqrt() / 2.0 * 0.25f64.powi(bits as i32);
                assert!(
                    mse <= bound && mse >= 0.9 * bound,
                    "dim {dim} bits {bits}: {mse} against the high-rate optimum {bound}"
                );
            }
        }
    }

    /// The same distortion measured on random unit vectors, rotated, coded and decoded.
    #[test]
    fn random_unit_vectors_round_trip_at_the_predicted_error() {
        let dim = 256;
        let rot = Rotation::new(dim, 11);
        let mut state = 99u64;
        let mut gaussian = || {
            // Box–Muller from two uniforms.
            let u1 = (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            let u2 = (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            ((-2.0 * u1.max(1e-300).ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        };
        for bits in [2u8, 3, 4, 6] {
            let book = Codebook::lloyd_max(dim, bits);
            let predicted = book.coordinate_mse(dim) * dim as f64;
            let trials = 400;
            let mut total = 0.0;
            for _ in 0..trials {
                let mut x: Vec<f32> = (0..dim).map(|_| gaussian()).collect();
                let n = x.iter().map(|a| a * a).sum::<f32>().sqrt();
                x.iter_mut().for_each(|a| *a /= n);
                let mut y = x.clone();
                rot.forward(&mut y);
                y.iter_mut().for_each(|a| *a = book.decode(book.encode(*a)));
                rot.inverse(&mut y);
                total += x
                    .iter()
                    .zip(&y)
                    .map(|(a, b)| ((a - b) as f64).powi(2))
                    .sum::<f64>();
            }
            let measured = total / trials as f64;
            assert!(
                (measured - predicted).abs() <= 0.1 * predicted,
                "bits {bits}: measured {measured}, predicted {predicted}"
            );
        }
    }

    #[test]
    fn codes_follow_cells() {
        let book = Codebook::lloyd_max(128, 3);
        assert_eq!(book.levels.len(), 8);
        assert!(book.levels.windows(2).all(|p| p[0] < p[1]));
        // Symmetric density, symmetric codebook.
        for (a, b) in book.levels.iter().zip(book.levels.iter().rev()) {
            assert!((a + b).abs() < 1e-4, "{a} {b}");
        }
        assert_eq!(book.encode(-1.0), 0);
        assert_eq!(book.encode(1.0), 7);
        for (c, &l) in book.levels.iter().enumerate() {
            assert_eq!(book.encode(l) as usize, c);
        }
    }
}
