//! `GET /metrics`: the engine's state in Prometheus' text exposition format (0.0.4).
//!
//! The engine thread keeps what it observes in a [`Tally`] and publishes it, together with
//! the batch's gauges, under one lock once per loop (after a step and before it waits for
//! work), so a scrape always sees one consistent moment: a cancelled request is counted in
//! the same snapshot that no longer shows its row as running.

use std::fmt::Write as _;
use std::sync::{Mutex, MutexGuard};
use tessera_engine::speculative::SpecStats;
use tessera_engine::BatchTimes;

/// Histogram bucket bounds in seconds, 1 ms to 60 s (`+Inf` is added).
pub const BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

/// How an engine request (one choice) ended, as `finish_reason` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Stop,
    Length,
    /// Its client went away.
    Cancelled,
    /// The engine failed it after it was accepted.
    Error,
}

const OUTCOMES: [(Outcome, &str); 4] = [
    (Outcome::Stop, "stop"),
    (Outcome::Length, "length"),
    (Outcome::Cancelled, "cancelled"),
    (Outcome::Error, "error"),
];

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Observations at most `BUCKETS[i]` (not cumulative; rendered cumulative).
    counts: [u64; BUCKETS.len()],
    /// Past the last bound.
    over: u64,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn observe(&mut self, seconds: f64) {
        let seconds = seconds.max(0.0);
        match BUCKETS.iter().position(|&b| seconds <= b) {
            Some(i) => self.counts[i] += 1,
            None => self.over += 1,
        }
        self.sum += seconds;
        self.count += 1;
    }

    fn add(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
        self.over += other.over;
        self.sum += other.sum;
        self.count += other.count;
    }

    pub fn count(&self) -> u64 {
        self.count
    }
}

/// What the engine observed since it last published (counters and histograms only).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    pub finished: [u64; 4],
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
}

impl Tally {
    pub fn finish(&mut self, outcome: Outcome, requests: u64) {
        let i = OUTCOMES
            .iter()
            .position(|(o, _)| *o == outcome)
            .unwrap_or(3);
        self.finished[i] += requests;
    }

    pub fn is_empty(&self) -> bool {
        *self == Tally::default()
    }
}

/// The batch's state at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub kv_bytes_allocated: usize,
    pub kv_bytes_reserved: usize,
    pub prefix_cache_bytes: usize,
    /// Since the server started (the totals the prefix store reports).
    pub prefix_cache_hits: u64,
    pub prefix_cache_tokens: u64,
    /// Since the server started: what speculation (`--spec`) drafted and accepted (all zero
    /// without it).
    pub spec: SpecStats,
    /// Since the server started: where the engine's time went.
    pub times: BatchTimes,
}

#[derive(Debug, Default)]
struct State {
    totals: Tally,
    gauges: Gauges,
}

/// Shared between the engine thread (writer) and the `/metrics` handler (reader).
#[derive(Debug, Default)]
pub struct Metrics {
    /// The KV budget in bytes (0: none).
    kv_budget: usize,
    state: Mutex<State>,
}

impl Metrics {
    pub fn new(kv_budget: Option<usize>) -> Metrics {
        Metrics {
            kv_budget: kv_budget.unwrap_or(0),
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves numbers, not broken invariants.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `tally` to the totals (and empties it) and sets the gauges.
    pub fn publish(&self, tally: &mut Tally, gauges: Gauges) {
        let mut s = self.lock();
        let t = std::mem::take(tally);
        for (a, b) in s.totals.finished.iter_mut().zip(t.finished) {
            *a += b;
        }
        s.totals.prompt_tokens += t.prompt_tokens;
        s.totals.generation_tokens += t.generation_tokens;
        s.totals.ttft.add(&t.ttft);
        s.totals.itl.add(&t.itl);
        s.gauges = gauges;
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let (totals, g) = {
            let s = self.lock();
            (s.totals.clone(), s.gauges.clone())
        };
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (suffix, value) in samples {
                let _ = writeln!(out, "{name}{suffix} {value}");
            }
        };
        let one = |v: u64| vec![(String::new(), v.to_string())];
        metric(
            "tessera_requests_running",
            "gauge",
            "Requests decoding in the running batch.",
            &one(g.running as u64),
        );
        metric(
            "tessera_requests_waiting",
            "gauge",
            "Requests queued or having their prompt read.",
            &one(g.waiting as u64),
        );
        metric(
            "tessera_kv_bytes_allocated",
            "gauge",
            "KV cache bytes the running and prefilling requests hold now.",
            &one(g.kv_bytes_allocated as u64),
        );
        metric(
            "tessera_kv_bytes_reserved",
            "gauge",
            "KV cache bytes the admitted requests may grow to (what the budget counts).",
            &one(g.kv_bytes_reserved as u64),
        );
        metric(
            "tessera_kv_budget_bytes",
            "gauge",
            "The KV budget in bytes (--kv-budget-mib); 0 means no budget.",
            &one(self.kv_budget as u64),
        );
        metric(
            "tessera_prefix_cache_bytes",
            "gauge",
            "KV bytes of finished requests kept for prefix reuse.",
            &one(g.prefix_cache_bytes as u64),
        );
        let finished: Vec<(String, String)> = OUTCOMES
            .iter()
            .zip(totals.finished)
            .map(|((_, label), v)| (format!("{{finish_reason=\"{label}\"}}"), v.to_string()))
            .collect();
        metric(
            "tessera_requests_total",
            "counter",
            "Engine requests (one per choice) that ended, by how: stop (end token or stop \
             string), length, cancelled (client gone), error.",
            &finished,
        );
        metric(
            "tessera_prompt_tokens_total",
            "counter",
            "Prompt tokens of the accepted engine requests.",
            &one(totals.prompt_tokens),
        );
        metric(
            "tessera_generation_tokens_total",
            "counter",
            "Tokens generated.",
            &one(totals.generation_tokens),
        );
        metric(
            "tessera_prefix_cache_hits_total",
            "counter",
            "Requests that reused a stored prefix.",
            &one(g.prefix_cache_hits),
        );
        metric(
            "tessera_prefix_cache_tokens_total",
            "counter",
            "Prompt tokens a stored prefix gave (not read again).",
            &one(g.prefix_cache_tokens),
        );
        for (name, help, v) in [
            (
                "tessera_spec_rounds_total",
                "Speculative rounds: a running request's draft verified in a step (--spec).",
                g.spec.rounds,
            ),
            (
                "tessera_spec_plain_steps_total",
                "Decode steps with speculation on that verified no draft (no match, or none \
                 left to draft).",
                g.spec.plain_steps,
            ),
            (
                "tessera_spec_drafted_tokens_total",
                "Tokens drafted by prompt lookup and verified.",
                g.spec.drafted,
            ),
            (
                "tessera_spec_accepted_tokens_total",
                "Drafted tokens accepted (generated without a step of their own).",
                g.spec.accepted,
            ),
        ] {
            metric(name, "counter", help, &one(v as u64));
        }
        let by_position = |counts: &[usize]| -> Vec<(String, String)> {
            counts
                .iter()
                .enumerate()
                .map(|(i, v)| (format!("{{position=\"{i}\"}}"), v.to_string()))
                .collect()
        };
        metric(
            "tessera_spec_drafted_by_position_total",
            "counter",
            "Speculative rounds that drafted a token at this draft position (from 0).",
            &by_position(&g.spec.drafted_at),
        );
        metric(
            "tessera_spec_accepted_by_position_total",
            "counter",
            "Speculative rounds that accepted the drafted token at this draft position.",
            &by_position(&g.spec.accepted_at),
        );
        for (name, help, h) in [
            (
                "tessera_time_to_first_token_seconds",
                "From the request's arrival to its first generated token.",
                &totals.ttft,
            ),
            (
                "tessera_inter_token_latency_seconds",
                "Between consecutive generated tokens of a request.",
                &totals.itl,
            ),
        ] {
            let mut samples = Vec::with_capacity(BUCKETS.len() + 3);
            let mut cumulative = 0;
            for (bound, count) in BUCKETS.iter().zip(h.counts) {
                cumulative += count;
                samples.push((format!("_bucket{{le=\"{bound}\"}}"), cumulative.to_string()));
            }
            samples.push(("_bucket{le=\"+Inf\"}".into(), h.count.to_string()));
            samples.push(("_sum".into(), format!("{}", h.sum)));
            samples.push(("_count".into(), h.count.to_string()));
            metric(name, "histogram", help, &samples);
        }
        let t = &g.times;
        for (name, help, v) in [
            (
                "tessera_prefill_seconds_total",
                "Time spent reading prompt chunks.",
                t.prefill.as_secs_f64(),
            ),
            (
                "tessera_decode_seconds_total",
                "Time spent in decode steps (each waits for its tokens and samples them).",
                t.decode.as_secs_f64(),
            ),
            (
                "tessera_decode_submit_seconds_total",
                "Of the decode time, the host's until each step's forward pass returned; on a GPU, \
                 close to the decode time means the steps are bound by the host.",
                t.decode_submit.as_secs_f64(),
            ),
            (
                "tessera_row_moves_seconds_total",
                "Time spent moving cache rows: prompts' rows joining the running batch, finished \
                 rows filtered out of it.",
                t.rows.as_secs_f64(),
            ),
        ] {
            metric(name, "counter", help, &[(String::new(), v.to_string())]);
        }
        for (name, help, v) in [
            (
                "tessera_prefill_tokens_total",
                "Prompt tokens read (not those a stored prefix gave).",
                t.prefill_tokens,
            ),
            (
                "tessera_prefill_forwards_total",
                "Forwards that read prompt tokens (several short prompts may share one).",
                t.prefill_forwards,
            ),
            (
                "tessera_decode_steps_total",
                "Decode steps (one forward for every running request).",
                t.decode_steps,
            ),
            (
                "tessera_decode_row_steps_total",
                "Running requests summed over the decode steps (divided by the steps: the mean \
                 batch).",
                t.decode_rows,
            ),
            (
                "tessera_row_moves_total",
                "Joins and leaves of the running batch (each a merge or a filter of its rows).",
                t.row_moves,
            ),
        ] {
            metric(name, "counter", help, &one(v as u64));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_has_every_metric_and_cumulative_buckets() {
        let m = Metrics::new(Some(1 << 20));
        let mut t = Tally::default();
        t.finish(Outcome::Cancelled, 2);
        t.finish(Outcome::Stop, 1);
        t.prompt_tokens = 7;
        t.generation_tokens = 3;
        t.ttft.observe(0.002);
        t.ttft.observe(0.3);
        t.itl.observe(100.0);
        m.publish(
            &mut t,
            Gauges {
                running: 1,
                waiting: 2,
                times: BatchTimes {
                    prefill: std::time::Duration::from_millis(1500),
                    prefill_tokens: 40,
                    prefill_forwards: 3,
                    decode_steps: 9,
                    decode_rows: 20,
                    ..Default::default()
                },
                ..Default::default()
            },
        );
        assert!(t.is_empty());
        let text = m.render();
        for line in [
            "tessera_requests_running 1",
            "tessera_requests_waiting 2",
            "tessera_kv_budget_bytes 1048576",
            "tessera_requests_total{finish_reason=\"cancelled\"} 2",
            "tessera_requests_total{finish_reason=\"stop\"} 1",
            "tessera_requests_total{finish_reason=\"error\"} 0",
            "tessera_prompt_tokens_total 7",
            "tessera_generation_tokens_total 3",
            "tessera_time_to_first_token_seconds_bucket{le=\"0.001\"} 0",
            "tessera_time_to_first_token_seconds_bucket{le=\"0.0025\"} 1",
            "tessera_time_to_first_token_seconds_bucket{le=\"0.5\"} 2",
            "tessera_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2",
            "tessera_time_to_first_token_seconds_count 2",
            "tessera_inter_token_latency_seconds_bucket{le=\"60\"} 0",
            "tessera_inter_token_latency_seconds_bucket{le=\"+Inf\"} 1",
            "tessera_inter_token_latency_seconds_sum 100",
            "# TYPE tessera_inter_token_latency_seconds histogram",
            "# TYPE tessera_prefix_cache_hits_total counter",
            "tessera_prefill_seconds_total 1.5",
            "tessera_prefill_tokens_total 40",
            "tessera_prefill_forwards_total 3",
            "tessera_decode_seconds_total 0",
            "tessera_decode_steps_total 9",
            "tessera_decode_row_steps_total 20",
            "# TYPE tessera_decode_submit_seconds_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        // Every sample line's metric has HELP and TYPE.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap_or("");
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|b| text.contains(&format!("# TYPE {b} histogram")))
                .unwrap_or(name);
            assert!(text.contains(&format!("# HELP {base} ")), "{l}");
        }
        // Without speculation the counters read 0.
        assert!(text
            .lines()
            .any(|l| l == "tessera_spec_drafted_tokens_total 0"));
    }

    #[test]
    fn speculation_counts_by_position() {
        let m = Metrics::new(None);
        let mut spec = SpecStats::default();
        spec.count_round(3, 1);
        spec.count_round(1, 1);
        spec.plain_steps = 2;
        m.publish(
            &mut Tally::default(),
            Gauges {
                spec,
                ..Default::default()
            },
        );
        let text = m.render();
        for line in [
            "tessera_spec_rounds_total 2",
            "tessera_spec_plain_steps_total 2",
            "tessera_spec_drafted_tokens_total 4",
            "tessera_spec_accepted_tokens_total 2",
            "tessera_spec_drafted_by_position_total{position=\"0\"} 2",
            "tessera_spec_drafted_by_position_total{position=\"2\"} 1",
            "tessera_spec_accepted_by_position_total{position=\"0\"} 2",
            "tessera_spec_accepted_by_position_total{position=\"1\"} 0",
            "# TYPE tessera_spec_accepted_by_position_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
