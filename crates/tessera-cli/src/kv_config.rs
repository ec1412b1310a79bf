//! `tessera kv-config auto`: per-layer key and value widths for a budget of bits per
//! element, from sensitivities measured on a calibration text
//! ([`tessera_engine::kv_auto`]).

use crate::commands::load;
use crate::ModelArgs;
use anyhow::{bail, Context, Result};
use std::path::Path;
use tessera_engine::eval::EvalMode;
use tessera_engine::kv_auto::{self, Allocation, Costs, PROBE_BITS};
use tessera_kv::Retention;

pub struct AutoArgs<'a> {
    pub text: &'a Path,
    pub budget: f64,
    pub out: Option<&'a Path>,
    pub ctx: usize,
    pub chunks: usize,
    pub kv_start: usize,
    /// Pair codebooks at the widths that have one.
    pub pairs: bool,
}

pub fn auto(margs: &ModelArgs, args: AutoArgs) -> Result<()> {
    if let Some(out) = args.out {
        if out.is_dir() {
            bail!("--out {} is a directory", out.display());
        }
    }
    let body = std::fs::read_to_string(args.text)
        .with_context(|| format!("cannot read text file {}", args.text.display()))?;
    // Calibration runs on the weights dequantized to f32: the shipped weights' int8
    // activations put every perturbed run ~0.006 KL from bf16, which would hide the
    // differences between layers.
    let margs = ModelArgs {
        f32_weights: true,
        ..margs.clone()
    };
    let (model, tok) = load(&margs)?;
    let ids = tok.encode(&body, true)?;
    let special = tok.special();
    let bos = special.bos.filter(|_| special.add_bos);
    let specs = model.layer_specs();
    // Checked before the probes, which take minutes.
    let costs = Costs::new(&specs)?;
    costs
        .check(args.budget)
        .with_context(|| format!("--budget {}", args.budget))?;
    let mode = EvalMode::Chunks {
        ctx: args.ctx,
        chunks: Some(args.chunks),
    };
    eprintln!(
        "probing {} layers' keys and values at {PROBE_BITS} bits: {} runs of {} × {}-token chunks",
        specs.len(),
        2 * specs.len() + 1,
        args.chunks,
        args.ctx
    );
    let sens = kv_auto::measure(&model, &ids, mode, bos, args.kv_start)?;
    let allocation = kv_auto::allocate(&specs, &costs, &sens, args.budget, args.pairs)?;
    print_table(&specs, &sens, &allocation);
    eprintln!(
        "{:.3} bits per element (budget {}), predicted KL vs bf16 {:.5}",
        costs.bits_per_element(&allocation),
        args.budget,
        kv_auto::predicted_kl(&specs, &sens, &allocation)
    );
    let json = serde_json::to_string_pretty(&kv_auto::config_json(&allocation, args.kv_start))?;
    match args.out {
        Some(path) => {
            std::fs::write(path, json + "\n")
                .with_context(|| format!("cannot write {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => println!("{json}"),
    }
    Ok(())
}

fn print_table(specs: &[tessera_kv::LayerSpec], sens: &kv_auto::Sensitivity, a: &Allocation) {
    eprintln!(
        "{:>5} {:>8} {:>12} {:>12} {:>6}",
        "layer",
        "kind",
        format!("key KL@{PROBE_BITS}"),
        format!("value KL@{PROBE_BITS}"),
        "bits"
    );
    for (l, spec) in specs.iter().enumerate() {
        let kind = match spec.retention {
            Retention::Full => "global",
            Retention::Window { .. } => "sliding",
        };
        let (k, v) = a.bits[l];
        eprintln!(
            "{l:>5} {kind:>8} {:>12.6} {:>12.6} {:>6}",
            sens.key[l],
            sens.value[l],
            format!("{k}:{v}")
        );
    }
}
