//! The commands that load a model and talk to the engine.

use crate::plot::{kl_vs_bits_svg, PlotPoint};
use crate::{KvArgs, ModelArgs, SampleArgs};
use anyhow::{bail, Context, Result};
use candle_core::Device;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tessera_engine::eval::{evaluate, EvalMode};
use tessera_engine::store::{self, FetchEvent};
use tessera_engine::{Generation, SamplerConfig, Session, TextStream};
use tessera_kv::KvScheme;
use tessera_models::{GgufFile, LoadOptions, Model, Tokenizer};

fn fetch_with_progress(force: bool) -> Result<PathBuf> {
    let bar = ProgressBar::new(store::DEFAULT_MODEL_BYTES);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes}")
            .unwrap()
            .progress_chars("=> "),
    );
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    let mut progress = |e: FetchEvent| match e {
        FetchEvent::Step(s) => bar.println(format!("tessera: {s}")),
        FetchEvent::Bytes(done, _) => {
            bar.set_message("assembling");
            bar.set_position(done)
        }
    };
    let path = if force {
        store::fetch_default_model(&mut progress)?
    } else {
        store::ensure_default_model(&mut progress)?
    };
    bar.finish_and_clear();
    Ok(path)
}

pub fn model_path(args: &ModelArgs) -> Result<PathBuf> {
    match &args.model {
        Some(p) => Ok(p.clone()),
        None => fetch_with_progress(false),
    }
}

/// The device `--device` names; for CUDA, with the KV backend installed.
pub fn device(name: &str) -> Result<Device> {
    let ordinal = match name.split_once(':') {
        None if name == "cpu" => return Ok(Device::Cpu),
        None if name == "cuda" => 0,
        Some(("cuda", n)) => n
            .parse()
            .with_context(|| format!("--device {name}: `{n}` is not a GPU number"))?,
        _ => bail!("--device {name}: expected cpu, cuda or cuda:N"),
    };
    cuda_device(ordinal)
}

#[cfg(feature = "cuda")]
fn cuda_device(ordinal: usize) -> Result<Device> {
    tessera_kernels::backend::install();
    let device =
        Device::new_cuda(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))?;
    if let Device::Cuda(cuda) = &device {
        // cudarc gives every allocation two CUDA events for ordering work across streams;
        // they are only waited on once a context has a second stream, which nothing in
        // tessera makes (candle's stream carries the model and the cache kernels alike),
        // so they would cost four driver calls per tensor for nothing.
        // SAFETY: one stream per device: no tensor is used on a stream other than the
        // one it was allocated on.
        unsafe { cuda.disable_event_tracking() };
    }
    Ok(device)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_ordinal: usize) -> Result<Device> {
    bail!(
        "this tessera was built without CUDA; rebuild with `cargo build --release --features cuda`"
    )
}

pub fn load(args: &ModelArgs) -> Result<(Model, Tokenizer)> {
    let device = device(&args.device)?;
    let path = model_path(args)?;
    let options = LoadOptions {
        // The Q8_0 re-encoding serves the CPU's repacked matmul only.
        reencode_q5_0: !args.keep_q5_0 && device.is_cpu(),
        dequantize: args.f32_weights,
        ..Default::default()
    };
    Ok(Model::load(&path, &options, &device)?)
}

pub fn scheme(kv: &str, kv_start: usize) -> Result<KvScheme> {
    let mut s = KvScheme::parse(kv)?;
    s.quantized_kv_start = kv_start;
    Ok(s)
}

/// A `--kv-config` file's scheme; its own `quantized_kv_start`, if it sets one, wins over
/// `--kv-start`.
pub fn scheme_from_config(path: &Path, kv_start: usize) -> Result<KvScheme> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read kv config {}", path.display()))?;
    let mut s = KvScheme::from_config_json(&text).with_context(|| format!("{}", path.display()))?;
    if !text.contains("quantized_kv_start") {
        s.quantized_kv_start = kv_start;
    }
    Ok(s)
}

/// The scheme of the shared `--kv` / `--kv-start` / `--kv-config` flags.
pub fn scheme_of(kv: &KvArgs) -> Result<KvScheme> {
    match &kv.kv_config {
        Some(path) => scheme_from_config(path, kv.kv_start),
        None => scheme(&kv.kv, kv.kv_start),
    }
}

fn sampler(args: &SampleArgs) -> Result<SamplerConfig> {
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!("--temperature must be a finite number ≥ 0");
    }
    if args.top_k == Some(0) {
        bail!("--top-k must be at least 1");
    }
    for (name, v) in [("--top-p", args.top_p), ("--min-p", args.min_p)] {
        if let Some(v) = v {
            if !(0.0..=1.0).contains(&v) {
                bail!("{name} must be between 0 and 1");
            }
        }
    }
    if !(args.repetition_penalty > 0.0 && args.repetition_penalty.is_finite()) {
        bail!("--repetition-penalty must be a finite number > 0");
    }
    Ok(SamplerConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..Default::default()
    })
}

fn stop_tokens(tok: &Tokenizer) -> Vec<u32> {
    let s = tok.special();
    std::iter::once(s.eos).chain(s.end_of_turn).collect()
}

/// A built-in chat format, told apart by the vocabulary's turn tokens. What opens a user
/// turn, starts the reply and closes a turn belongs to the template, so a renderer of the
/// GGUF's own `tokenizer.chat_template` can take its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatFormat {
    Gemma,
    Llama3,
    /// Qwen's.
    ChatMl,
}

impl ChatFormat {
    /// The format the vocabulary was trained with; `has_token` says whether a token with
    /// that text exists.
    pub fn detect(has_token: impl Fn(&str) -> bool) -> Result<ChatFormat> {
        if has_token("<start_of_turn>") {
            Ok(ChatFormat::Gemma)
        } else if has_token("<|start_header_id|>") {
            Ok(ChatFormat::Llama3)
        } else if has_token("<|im_start|>") {
            Ok(ChatFormat::ChatMl)
        } else {
            bail!(
                "no chat format known for this vocabulary (Gemma, Llama 3 and ChatML turn tokens are)"
            )
        }
    }

    pub fn of(tok: &Tokenizer) -> Result<ChatFormat> {
        ChatFormat::detect(|t| tok.token_id(t).is_some())
    }

    /// The text that closes a turn, the user's or the model's.
    pub fn end_of_turn(self) -> &'static str {
        match self {
            ChatFormat::Gemma => "<end_of_turn>\n",
            ChatFormat::Llama3 => "<|eot_id|>",
            ChatFormat::ChatMl => "<|im_end|>\n",
        }
    }

    /// A user turn, closed, and the start of the reply.
    pub fn user_turn(self, text: &str) -> String {
        let (user, reply) = match self {
            ChatFormat::Gemma => ("<start_of_turn>user\n", "<start_of_turn>model\n"),
            ChatFormat::Llama3 => (
                "<|start_header_id|>user<|end_header_id|>\n\n",
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
            ),
            ChatFormat::ChatMl => ("<|im_start|>user\n", "<|im_start|>assistant\n"),
        };
        format!("{user}{text}{}{reply}", self.end_of_turn())
    }
}

pub fn generate(
    margs: &ModelArgs,
    prompt: &str,
    max_tokens: usize,
    sargs: &SampleArgs,
    kv: &KvArgs,
    prefill_chunk: usize,
    chat_template: bool,
) -> Result<()> {
    let scheme = scheme_of(kv)?;
    let sampler = sampler(sargs)?;
    let t0 = Instant::now();
    let (model, tok) = load(margs)?;
    let load_time = t0.elapsed();
    let text = if chat_template {
        ChatFormat::of(&tok)?.user_turn(prompt)
    } else {
        prompt.to_string()
    };
    let ids = tok.encode(&text, true)?;
    let mut session = Session::new(&model, &scheme, prefill_chunk)?;
    let mut gen = Generation::new(&mut session, &ids, sampler, max_tokens, stop_tokens(&tok))?;
    let mut stream = TextStream::new();
    let mut out = std::io::stdout().lock();
    let mut produced = 0;
    for t in gen.by_ref() {
        let piece = stream.push(&tok, t?)?;
        out.write_all(piece.as_bytes())?;
        out.flush()?;
        produced += 1;
    }
    out.write_all(stream.finish().as_bytes())?;
    writeln!(out)?;
    let reason = gen.stop_reason();
    let s = gen.session();
    eprintln!(
        "[load {:.2} s | prompt {} tokens, {:.1} tok/s | generated {} tokens, {:.1} tok/s | stop: {:?} | kv {}]",
        load_time.as_secs_f64(),
        ids.len(),
        s.prefill_tokens.max(1) as f64 / s.prefill_time.as_secs_f64().max(1e-9),
        produced,
        s.decode_tokens as f64 / s.decode_time.as_secs_f64().max(1e-9),
        reason,
        scheme,
    );
    Ok(())
}

pub fn chat(
    margs: &ModelArgs,
    max_tokens: usize,
    sargs: &SampleArgs,
    kv: &KvArgs,
    prefill_chunk: usize,
) -> Result<()> {
    let scheme = scheme_of(kv)?;
    let sampler = sampler(sargs)?;
    let (model, tok) = load(margs)?;
    let template = ChatFormat::of(&tok)?;
    let mut session = Session::new(&model, &scheme, prefill_chunk)?;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!(
        "tessera chat ({}; /reset starts over, /quit or Ctrl-D leaves)",
        model.architecture()
    );
    loop {
        write!(out, "> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            writeln!(out)?;
            return Ok(());
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/quit" | "/exit" => return Ok(()),
            "/reset" => {
                session = Session::new(&model, &scheme, prefill_chunk)?;
                eprintln!("(conversation reset)");
                continue;
            }
            _ => {}
        }
        let first = session.tokens().is_empty();
        let ids = tok.encode(&template.user_turn(line), first)?;
        let mut gen = match Generation::new(
            &mut session,
            &ids,
            sampler.clone(),
            max_tokens,
            stop_tokens(&tok),
        ) {
            Ok(g) => g,
            Err(e) => {
                eprintln!("error: {e} (try /reset)");
                continue;
            }
        };
        let mut stream = TextStream::new();
        for t in gen.by_ref() {
            let piece = stream.push(&tok, t?)?;
            write!(out, "{piece}")?;
            out.flush()?;
        }
        writeln!(out, "{}", stream.finish())?;
        // Close the model's turn so the next user turn follows the template.
        let close = tok.encode(template.end_of_turn(), false)?;
        if session.context_left() > close.len() {
            session.feed(&close)?;
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn eval(
    margs: &ModelArgs,
    text: &Path,
    kv: &str,
    kv_start: usize,
    kv_config: Option<&Path>,
    ctx: Option<usize>,
    chunks: Option<usize>,
    prefill: usize,
    tokens: usize,
    json: bool,
    plot: Option<&Path>,
) -> Result<()> {
    if let Some(path) = plot {
        check_plot_path(path)?;
    }
    let mut schemes: Vec<(String, KvScheme)> = kv
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| Ok((s.to_string(), scheme(s, kv_start)?)))
        .collect::<Result<_>>()?;
    if let Some(path) = kv_config {
        schemes.push((
            path.display().to_string(),
            scheme_from_config(path, kv_start)?,
        ));
    }
    if schemes.is_empty() {
        bail!("--kv lists no scheme");
    }
    let body = std::fs::read_to_string(text)
        .with_context(|| format!("cannot read text file {}", text.display()))?;
    let (model, tok) = load(margs)?;
    let ids = tok.encode(&body, true)?;
    if ids.len() < 2 {
        bail!(
            "the text has {} tokens; eval needs at least 2 ({})",
            ids.len(),
            text.display()
        );
    }
    // Each chunk starts with BOS when the vocabulary adds one (as in llama-perplexity).
    let special = tok.special();
    let bos = special.bos.filter(|_| special.add_bos);
    let mode = match ctx {
        Some(ctx) => EvalMode::Chunks { ctx, chunks },
        None => EvalMode::Decode { prefill, tokens },
    };
    let results = evaluate(&model, &ids, &schemes, mode, bos)?;
    if let Some(path) = plot {
        let regime = match mode {
            // Same count `evaluate` uses: whole chunks the text holds, capped by --chunks.
            EvalMode::Chunks { ctx, chunks } => {
                let n = chunks.map_or(ids.len() / ctx, |c| c.min(ids.len() / ctx));
                format!("ctx {ctx} × {n} chunk{}", if n == 1 { "" } else { "s" })
            }
            EvalMode::Decode { prefill, tokens } => {
                format!("prefill {prefill}, decode {tokens}")
            }
        };
        let name = text.file_name().map_or(text.display().to_string(), |n| {
            n.to_string_lossy().into_owned()
        });
        let points: Vec<PlotPoint> = results
            .iter()
            .map(|r| PlotPoint {
                label: r.kv.clone(),
                bits: r.bits_per_element,
                kl: r.kl_vs_bf16.unwrap_or(0.0),
            })
            .collect();
        let svg = kl_vs_bits_svg(&points, &format!("KL vs bf16 by KV bits: {name}, {regime}"));
        std::fs::write(path, svg)
            .with_context(|| format!("cannot write plot {}", path.display()))?;
    }
    if json {
        let entries: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "kv": r.kv, "ppl": r.ppl, "kl_vs_bf16": r.kl_vs_bf16, "top1_agree": r.top1_agree,
                    "kv_bytes_per_token": r.kv_bytes_per_token, "bits_per_element": r.bits_per_element,
                    "tokens_scored": r.tokens_scored,
                })
            })
            .collect();
        println!("{}", serde_json::json!({ "schemes": entries }));
    } else {
        println!(
            "{:<16} {:>10} {:>12} {:>10} {:>14} {:>6} {:>8}",
            "kv", "ppl", "kl_vs_bf16", "top1", "kv_bytes/tok", "bits", "scored"
        );
        for r in &results {
            let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
            println!(
                "{:<16} {:>10.4} {:>12} {:>10} {:>14.0} {:>6.2} {:>8}",
                r.kv,
                r.ppl,
                opt(r.kl_vs_bf16, 6),
                opt(r.top1_agree, 4),
                r.kv_bytes_per_token,
                r.bits_per_element,
                r.tokens_scored
            );
        }
    }
    Ok(())
}

/// Refused before the model loads, so a long eval never ends in a file it cannot write.
fn check_plot_path(path: &Path) -> Result<()> {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    if let Some(ext) = ext.filter(|e| e != "svg") {
        bail!(
            "--plot writes SVG only, not .{ext}: give a file name ending in .svg ({})",
            path.display()
        );
    }
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) if !dir.is_dir() => bail!("--plot: no directory {}", dir.display()),
        _ => Ok(()),
    }
}

pub fn fetch() -> Result<()> {
    let path = fetch_with_progress(true)?;
    println!("{}", path.display());
    Ok(())
}

/// `tessera model fetch-vocab`: the tokenizer test vocabularies into $TESSERA_HOME/vocab.
pub fn fetch_vocab(force: bool) -> Result<()> {
    let mut progress = |e: FetchEvent| {
        if let FetchEvent::Step(s) = e {
            eprintln!("tessera: {s}");
        }
    };
    let dir = if force {
        store::fetch_test_vocabularies(&mut progress)
    } else {
        store::ensure_test_vocabularies(&mut progress)
    }
    .map_err(|e| match e {
        tessera_engine::EngineError::Fetch(m) => anyhow::anyhow!("test vocabularies: {m}"),
        e => e.into(),
    })?;
    println!("{}", dir.display());
    Ok(())
}

pub fn info(model: Option<&Path>) -> Result<()> {
    let path = match model {
        Some(p) => p.to_path_buf(),
        None => fetch_with_progress(false)?,
    };
    let g = GgufFile::open(&path)?;
    let arch = g.architecture()?;
    let key = |k: &str| format!("{arch}.{k}");
    let num = |k: &str| {
        g.u32(&key(k))
            .map(|v| v.to_string())
            .unwrap_or_else(|_| "?".into())
    };
    println!("file:          {}", path.display());
    println!("architecture:  {arch}");
    if let Ok(name) = g.string("general.name") {
        println!("name:          {name}");
    }
    println!("layers:        {}", num("block_count"));
    println!("hidden:        {}", num("embedding_length"));
    println!(
        "heads:         {} query, {} kv",
        num("attention.head_count"),
        num("attention.head_count_kv")
    );
    println!("head_dim:      {}", num("attention.key_length"));
    println!("ffn:           {}", num("feed_forward_length"));
    println!("context:       {}", num("context_length"));
    if let Ok(w) = g.u32(&key("attention.sliding_window")) {
        println!("sliding window: {w}");
    }
    println!(
        "vocab:         {}",
        g.array("tokenizer.ggml.tokens")
            .map(|a| a.len().to_string())
            .unwrap_or_else(|_| "?".into())
    );
    let types: Vec<String> = g
        .tensor_types()
        .iter()
        .map(|(t, n)| format!("{t} {n}"))
        .collect();
    println!("tensor types:  {}", types.join(", "));
    Ok(())
}

/// `model synth`: a random-weight GGUF of a preset's shapes.
pub fn synth(arch: &str, preset: &str, out: &Path, dtype: &str, seed: u64) -> Result<()> {
    use tessera_models::synth;
    let shape = synth::preset(arch, preset)?;
    let dtype = synth::parse_dtype(dtype)?;
    let t = std::time::Instant::now();
    synth::write_model(&shape, dtype, seed, out)?;
    let bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    println!(
        "wrote {} ({}: {:.2} B parameters, {:?}, {:.1} MiB) in {:.1} s",
        out.display(),
        shape.name,
        shape.parameters() as f64 / 1e9,
        dtype,
        bytes as f64 / (1 << 20) as f64,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::ChatFormat;

    fn vocab(tokens: &'static [&'static str]) -> impl Fn(&str) -> bool {
        move |t| tokens.contains(&t)
    }

    #[test]
    fn chat_templates_are_told_apart_by_turn_tokens() {
        let detect = |tokens| ChatFormat::detect(vocab(tokens)).ok();
        assert_eq!(
            detect(&["<start_of_turn>", "<end_of_turn>"]),
            Some(ChatFormat::Gemma)
        );
        assert_eq!(
            detect(&["<|start_header_id|>", "<|eot_id|>"]),
            Some(ChatFormat::Llama3)
        );
        assert_eq!(
            detect(&["<|im_start|>", "<|im_end|>"]),
            Some(ChatFormat::ChatMl)
        );
        assert_eq!(detect(&["<s>", "</s>"]), None);
    }

    #[test]
    fn each_template_closes_turns_with_its_own_end_of_turn() {
        // What `chat` feeds after each reply, so the next user turn follows the template.
        let cases = [
            (ChatFormat::Gemma, "<end_of_turn>\n"),
            (ChatFormat::Llama3, "<|eot_id|>"),
            (ChatFormat::ChatMl, "<|im_end|>\n"),
        ];
        for (template, close) in cases {
            assert_eq!(template.end_of_turn(), close, "{template:?}");
        }
        // The same text closes the user's turn inside the template.
        assert_eq!(
            ChatFormat::Gemma.user_turn("Hi"),
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            ChatFormat::Llama3.user_turn("Hi"),
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(
            ChatFormat::ChatMl.user_turn("Hi"),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
