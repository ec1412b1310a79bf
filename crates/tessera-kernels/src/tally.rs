//! The pass/fail count every device check binary keeps (`kv-cache-parity`,
//! `kv-read-bench`, `weights-bench`): each comparison counted, a part that stops with an
//! error counted as one failure while the others still run, `--plant-failure` perturbing
//! the first output compared, and one summary line, `TOOL: N passed, M failed`, whose
//! verdict sets the exit status.

use std::fmt::Display;

#[derive(Debug, Default)]
pub struct Tally {
    pub passed: usize,
    pub failed: usize,
    /// `--plant-failure`: the next compared output is perturbed (then cleared).
    plant: bool,
}

impl Tally {
    /// A tally that plants one failure when `plant` (`--plant-failure` was given).
    pub fn new(plant: bool) -> Self {
        Tally {
            plant,
            ..Default::default()
        }
    }

    pub fn record(&mut self, ok: bool) {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
    }

    /// Records `rel <= bound` (false for NaN) and returns it.
    pub fn within(&mut self, rel: f64, bound: f64) -> bool {
        let ok = rel <= bound;
        self.record(ok);
        ok
    }

    /// A part that stopped with `error`: one failed check, said on stdout.
    pub fn stopped(&mut self, part: &str, error: impl Display) {
        println!("{part} stopped with an error: {error}: FAIL");
        self.failed += 1;
    }

    /// Whether to perturb this output: true once, for the first output compared after
    /// `--plant-failure`.
    pub fn take_plant(&mut self) -> bool {
        std::mem::take(&mut self.plant)
    }

    /// Ends a run with checks: a planted failure that found nothing to perturb fails too;
    /// prints `TOOL: N passed, M failed` and returns whether the run passed (some check
    /// passed and none failed).
    pub fn finish(&mut self, tool: &str) -> bool {
        if self.take_plant() {
            println!("--plant-failure: no output was compared to perturb: FAIL");
            self.failed += 1;
        }
        println!("{tool}: {} passed, {} failed", self.passed, self.failed);
        self.passes()
    }

    /// Some check passed and none failed.
    pub fn passes(&self) -> bool {
        self.failed == 0 && self.passed > 0
    }
}

#[cfg(test)]
mod tests {
    use super::Tally;

    #[test]
    fn a_run_passes_only_with_checks_and_no_miss() {
        let mut t = Tally::new(false);
        assert!(!t.finish("t"), "nothing checked");
        assert!(t.within(1e-7, 1e-6));
        assert!(!t.within(f64::NAN, 1e-6), "NaN is a miss");
        assert_eq!((t.passed, t.failed), (1, 1));
        assert!(!t.finish("t"));
        let mut t = Tally::new(false);
        t.record(true);
        assert!(t.finish("t"));
        t.stopped("part", "boom");
        assert!(!t.passes());
    }

    #[test]
    fn a_planted_failure_is_taken_once_or_fails_the_run() {
        let mut t = Tally::new(true);
        assert!(t.take_plant());
        assert!(!t.take_plant());
        let mut unused = Tally::new(true);
        unused.record(true);
        assert!(!unused.finish("t"), "a plant nothing took");
    }
}
