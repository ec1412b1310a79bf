//! `tessera bench` runs on the step engine: `--batch B` decodes B rows resumed from one
//! `--depth` context, and the figures it reports hold together (the running rows' KV is at
//! least B rows of the context and the decoded tokens, a step is no shorter than its
//! submit time).

mod common;

use common::{model, tessera};
use serde_json::Value;

#[test]
fn batched_decode_runs_every_row_at_depth() {
    let model = model();
    let (rows, depth, steps) = (3usize, 40usize, 4usize);
    let (code, out, err) = tessera(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--kv",
        "affine:4",
        "--batch",
        &rows.to_string(),
        "--depth",
        &depth.to_string(),
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        &steps.to_string(),
        "--repeat",
        "1",
        "--json",
    ]);
    assert_eq!(code, 0, "stderr: {err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["batch"], rows);
    let num = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {out}"));
    assert!(
        num("prefill_tok_s") > 0.0 && num("decode_tok_s") > 0.0,
        "{out}"
    );
    assert!(num("decode_step_ms") >= num("decode_submit_ms"), "{out}");
    // Each row holds the context and every token it decoded (at least the timed ones).
    let per_token = num("kv_bytes_per_token");
    let allocated = num("kv_allocated_bytes");
    assert!(per_token > 0.0, "{out}");
    assert!(
        allocated >= (rows * (depth + steps)) as f64 * per_token,
        "{allocated} bytes allocated for {rows} rows of {depth}+{steps} positions at {per_token}: {out}"
    );
}
