//! The commands that load a model and talk to the engine.

use crate::plot::{kl_vs_bits_svg, PlotPoint};
use crate::spec::{self, SpecArgs};
use crate::{KvArgs, ModelArgs, SampleArgs};
use anyhow::{bail, Context, Result};
use candle_core::Device;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tessera_engine::chat::{ChatTemplate, Message, TemplateOrigin};
use tessera_engine::eval::{evaluate, EvalMode};
use tessera_engine::prompt::{self, Prompt, PromptInput};
use tessera_engine::prompt_cache::{self, ReuseLimit};
use tessera_engine::store::{self, FetchEvent};
use tessera_engine::{SamplerConfig, Session, StopReason, TextStream, DEFAULT_PREFILL_CHUNK};
use tessera_kv::{Isa, KvScheme};
use tessera_models::{GgufFile, LoadOptions, Model, Tokenizer};
use tessera_server::engine::{Drafting, ServeSpec};

/// Runs `f` with a progress callback that draws a bar on stderr (steps as lines above it).
fn with_progress<T>(
    f: impl FnOnce(&mut dyn FnMut(FetchEvent)) -> Result<T, tessera_engine::EngineError>,
) -> Result<T> {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes}")
            .unwrap()
            .progress_chars("=> "),
    );
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    let mut progress = |e: FetchEvent| match e {
        FetchEvent::Step(s) => bar.println(format!("tessera: {s}")),
        FetchEvent::Bytes(done, total) => {
            bar.set_message("assembling");
            bar.set_length(total);
            bar.set_position(done)
        }
    };
    let result = f(&mut progress);
    bar.finish_and_clear();
    Ok(result?)
}

/// The model file `--model` names (a path, or a registry name fetched on first use), or
/// the default model.
pub fn model_path(args: &ModelArgs) -> Result<PathBuf> {
    resolve_model(args.model.as_deref(), "--model")
}

/// The model file `arg` names (`flag` is the option that named it, for its errors).
fn resolve_model(arg: Option<&Path>, flag: &str) -> Result<PathBuf> {
    with_progress(|p| store::resolve_model(arg, flag, p))
}

/// The device `--device` names; for CUDA, with the KV backend installed (timing its
/// writes and reads with `kv_profile`).
pub fn device(name: &str, kv_profile: bool) -> Result<Device> {
    let ordinal = match name.split_once(':') {
        None if name == "cpu" => return Ok(Device::Cpu),
        None if name == "cuda" => 0,
        Some(("cuda", n)) => n
            .parse()
            .with_context(|| format!("--device {name}: `{n}` is not a GPU number"))?,
        _ => bail!("--device {name}: expected cpu, cuda or cuda:N"),
    };
    cuda_device(ordinal, kv_profile)
}

#[cfg(feature = "cuda")]
fn cuda_device(ordinal: usize, kv_profile: bool) -> Result<Device> {
    tessera_kernels::backend::install_with(kv_profile);
    tessera_kernels::weights::install();
    tessera_kernels::graphs::install();
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
fn cuda_device(_ordinal: usize, _kv_profile: bool) -> Result<Device> {
    bail!(
        "this tessera was built without CUDA; rebuild with `cargo build --release --features cuda`"
    )
}

pub fn load(args: &ModelArgs) -> Result<(Model, Tokenizer)> {
    let device = device(&args.device, args.kv_profile)?;
    // The CPU's numerics are batch-invariant always; on a GPU it is a mode.
    tessera_models::device_weights::set_deterministic(args.deterministic && !device.is_cpu());
    let path = model_path(args)?;
    let options = LoadOptions {
        // The Q8_0 re-encoding serves the CPU's repacked matmul only.
        reencode_q5_0: !args.keep_q5_0 && device.is_cpu(),
        dequantize: args.f32_weights,
        isa: isa(args.isa.as_deref())?,
        device_weights: !args.candle_weights,
        step_graphs: !args.no_step_graphs,
        step_graph_rows: args.step_graph_rows,
        live_step_graphs: !args.no_live_step_graphs,
        check_step_graphs: args.check_step_graphs,
        ..Default::default()
    };
    Ok(Model::load(&path, &options, &device)?)
}

/// `--isa`: a level name, capped to what this CPU runs (the detected level without it).
fn isa(name: Option<&str>) -> Result<Isa> {
    let Some(name) = name else {
        return Ok(Isa::detected());
    };
    match Isa::parse(name) {
        Some(level) => Ok(level.capped()),
        None => bail!(
            "--isa {name:?}: unknown level; use one of {}",
            Isa::ALL.map(|l| l.to_string()).join(", ")
        ),
    }
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

/// Says (on stderr) when the scheme leaves the model's sliding-window layers in another
/// codec than the rest.
pub fn notice_scheme(model: &Model, scheme: &KvScheme) {
    if let Some(note) = tessera_kv::sliding_notice(&model.layer_specs(), scheme) {
        eprintln!("note: {note}");
    }
}

/// The scheme of the shared `--kv` / `--kv-start` / `--kv-config` flags (`bf16` by
/// default).
pub fn scheme_of(kv: &KvArgs) -> Result<KvScheme> {
    Ok(match explicit_scheme(kv)? {
        Some(s) => s,
        None => scheme("bf16", kv.kv_start)?,
    })
}

/// The scheme `--kv` or `--kv-config` names, if either is given (a prompt cache brings
/// its own otherwise).
pub fn explicit_scheme(kv: &KvArgs) -> Result<Option<KvScheme>> {
    Ok(match (&kv.kv_config, &kv.kv) {
        (Some(path), _) => Some(scheme_from_config(path, kv.kv_start)?),
        (None, Some(name)) => Some(scheme(name, kv.kv_start)?),
        (None, None) => None,
    })
}

/// The label of the scheme flags: the config file's path, the `--kv` text, or `bf16`.
pub fn scheme_label(kv: &KvArgs) -> String {
    match (&kv.kv_config, &kv.kv) {
        (Some(path), _) => path.display().to_string(),
        (None, Some(name)) => name.clone(),
        (None, None) => "bf16".into(),
    }
}

/// A session for the prompt `ids`: from the prompt cache at `file` when given (the prefix
/// `ids` shares with it is reused; what happened is said on stderr), else a fresh cache
/// of the flags' scheme. Returns the session, how many leading `ids` it already holds, and
/// the scheme it runs.
fn open_session<'m>(
    model: &'m Model,
    kv: &KvArgs,
    ids: &[u32],
    prefill_chunk: usize,
    file: Option<&Path>,
    round_slack: usize,
) -> Result<(Session<'m>, usize, KvScheme)> {
    let Some(file) = file else {
        let scheme = scheme_of(kv)?;
        notice_scheme(model, &scheme);
        let session = Session::new(model, &scheme, prefill_chunk)?.with_round_slack(round_slack);
        return Ok((session, 0, scheme));
    };
    let t = Instant::now();
    let explicit = explicit_scheme(kv)?;
    let cached = prompt_cache::load(file, model, explicit.as_ref())?;
    let loaded = t.elapsed();
    let scheme = cached.scheme.clone();
    notice_scheme(model, &scheme);
    let held = cached.tokens.first().map_or(0, Vec::len);
    let (session, reuse) = cached.resume(model, &scheme, ids, prefill_chunk)?;
    let why = match reuse.limited_by {
        Some(ReuseLimit::Floor(tessera_kv::NEVER_REUSED)) => format!(
            " (its quantized codec was fitted on a prompt shorter than {} tokens, which no other \
             prompt's fresh cache would be)",
            tessera_kv::FIRST_APPEND
        ),
        Some(ReuseLimit::Floor(f)) => {
            format!(" (the shared prefix is below the cache's reuse floor of {f})")
        }
        Some(ReuseLimit::Ring) => {
            " (a sliding-window ring no longer holds where the prompt parts from the cache)".into()
        }
        None => String::new(),
    };
    eprintln!(
        "tessera: prompt cache {}: {held} tokens loaded in {:.0} ms; {} of the prompt's {} tokens reused{why}",
        file.display(),
        loaded.as_secs_f64() * 1e3,
        reuse.tokens,
        ids.len()
    );
    Ok((session, reuse.tokens, scheme))
}

fn sampler(args: &SampleArgs) -> Result<SamplerConfig> {
    let config = SamplerConfig {
        temperature: args.temperature,
        // llama.cpp's conventions: top-k 0, top-p 1 and min-p 0 are off; any other value
        // goes to the engine's check (so `--top-p 1.5` is refused, not taken as off).
        top_k: (args.top_k > 0).then_some(args.top_k),
        top_p: (args.top_p != 1.0).then_some(args.top_p),
        min_p: (args.min_p != 0.0).then_some(args.min_p),
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..Default::default()
    };
    // The engine names the setting as OpenAI spells it (`top_p`); the flag is `--top-p`.
    config.validate().map_err(|e| match e {
        tessera_engine::EngineError::Field { field, message } => {
            let flag = field.replace('_', "-");
            anyhow::anyhow!(
                "--{flag}{}",
                message.strip_prefix(field).unwrap_or(&message)
            )
        }
        e => e.into(),
    })?;
    Ok(config)
}

/// The model file's chat template, else the built-in format its vocabulary fits, announced
/// once on stderr.
fn chat_template(tok: &Tokenizer) -> Result<ChatTemplate> {
    let template = prompt::model_chat_template(tok)?;
    if template.origin() != TemplateOrigin::File {
        eprintln!("tessera: using {}", template.origin());
    }
    Ok(template)
}

/// The summary line's words for why generation stopped.
fn stop_words(
    reason: Option<StopReason>,
    token: Option<u32>,
    tok: &Tokenizer,
    chat: bool,
) -> String {
    match reason {
        Some(StopReason::MaxTokens) => "max tokens".into(),
        Some(StopReason::ContextLimit) => "context full".into(),
        Some(StopReason::StopString) => "stop string".into(),
        Some(StopReason::EndToken) => {
            let what = if !chat && token == Some(tok.special().eos) {
                "end of text"
            } else {
                "end of turn"
            };
            match token.and_then(|t| tok.token_text(t)) {
                Some(text) => format!("{what} {text}"),
                None => what.into(),
            }
        }
        None => "error".into(),
    }
}

/// What compiling our CUDA kernels cost this process. A fresh machine's first run spends
/// seconds there; the driver's disk cache spares later ones.
pub fn kernel_compile_report() -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        let t = tessera_kernels::compile::compile_time();
        (!t.is_zero()).then(|| {
            format!(
                "CUDA kernels compiled and loaded in {:.2} s",
                t.as_secs_f64()
            )
        })
    }
    #[cfg(not(feature = "cuda"))]
    None
}

/// What `--check-step-graphs` found, as a line, where the flag is on.
pub fn step_graph_report(model: &Model, margs: &ModelArgs) -> Option<String> {
    margs.check_step_graphs.then(|| {
        let c = model.step_graph_checks();
        format!(
            "step graph checks: {} replayed steps compared with eager runs, {} differed{}",
            c.compared,
            c.differed,
            c.first_difference
                .map(|d| format!(" (first: {d})"))
                .unwrap_or_default()
        )
    })
}

#[allow(clippy::too_many_arguments)]
pub fn generate(
    margs: &ModelArgs,
    prompt: &str,
    max_tokens: usize,
    sargs: &SampleArgs,
    kv: &KvArgs,
    prefill_chunk: usize,
    chat_template: bool,
    prompt_cache: Option<&Path>,
    spec: &SpecArgs,
) -> Result<()> {
    // Bad flags are refused before the model loads.
    explicit_scheme(kv)?;
    let choice = spec.choice()?;
    let sampler = sampler(sargs)?;
    let t0 = Instant::now();
    let (model, tok) = load(margs)?;
    let draft = match &choice {
        Some(c) => c.load(margs, &tok)?,
        None => None,
    };
    let load_time = t0.elapsed();
    let Prompt {
        ids,
        stop_tokens: stops,
    } = if chat_template {
        let template = self::chat_template(&tok)?;
        let turn = [Message::user(prompt)];
        Prompt::new(&tok, Some(&template), PromptInput::Chat(&turn))?
    } else {
        Prompt::new(&tok, None, PromptInput::Text(prompt))?
    };
    let (mut session, reused, scheme) =
        open_session(&model, kv, &ids, prefill_chunk, prompt_cache, spec.slack())?;
    let batch_spec = choice
        .as_ref()
        .map(|c| c.batch_spec(draft.as_ref(), spec.draft_tokens))
        .transpose()?;
    let mut stream = TextStream::new();
    let mut out = std::io::stdout().lock();
    let mut produced = 0;
    let mut first_at = None;
    let outcome = spec::run(
        &mut session,
        &ids[reused..],
        sampler,
        max_tokens,
        stops,
        batch_spec,
        !margs.no_steps_ahead,
        |t| {
            let piece = stream.push(&tok, t)?;
            out.write_all(piece.as_bytes())?;
            out.flush()?;
            produced += 1;
            first_at.get_or_insert_with(Instant::now);
            Ok(())
        },
    )?;
    let s = &session;
    // The tokens after the first over the time since it was out: the same measure for
    // plain decode and for speculative rounds (which read chunks).
    let decode_rate = first_at.map_or(0.0, |t| {
        (produced.max(1) - 1) as f64 / t.elapsed().as_secs_f64().max(1e-9)
    });
    let prefill_rate = s.prefill_tokens.max(1) as f64 / s.prefill_time.as_secs_f64().max(1e-9);
    out.write_all(stream.finish().as_bytes())?;
    writeln!(out)?;
    let reason = stop_words(outcome.reason, outcome.stop_token, &tok, chat_template);
    let cached = if reused > 0 {
        format!(" ({reused} from the prompt cache)")
    } else {
        String::new()
    };
    let spec_line = match (&choice, &outcome.spec) {
        (Some(c), Some(st)) => format!(" | spec {}: {}", c.label(draft.as_ref()), st.summary()),
        _ => String::new(),
    };
    let ahead_line = match outcome.steps_ahead {
        0 => String::new(),
        n => format!(" | {n} of the steps ran ahead"),
    };
    eprintln!(
        "[load {:.2} s | prompt {} tokens{cached}, {:.1} tok/s | generated {} tokens, {:.1} tok/s | stop: {} | kv {}{}{}]",
        load_time.as_secs_f64(),
        ids.len(),
        prefill_rate,
        produced,
        decode_rate,
        reason,
        scheme,
        spec_line,
        ahead_line,
    );
    if let Some(line) = step_graph_report(&model, margs) {
        eprintln!("[{line}]");
    }
    if let Some(line) = kernel_compile_report() {
        eprintln!("[{line}]");
    }
    Ok(())
}

pub fn chat(
    margs: &ModelArgs,
    max_tokens: usize,
    sargs: &SampleArgs,
    kv: &KvArgs,
    prefill_chunk: usize,
    prompt_cache: Option<&Path>,
    spec: &SpecArgs,
) -> Result<()> {
    explicit_scheme(kv)?;
    let choice = spec.choice()?;
    let sampler = sampler(sargs)?;
    let (model, tok) = load(margs)?;
    let draft = match &choice {
        Some(c) => c.load(margs, &tok)?,
        None => None,
    };
    let template = chat_template(&tok)?;
    let stops = prompt::chat_stop_tokens(&tok, &template);
    // A prompt cache starts every conversation (also after /reset); each turn keeps the
    // prefix it shares with it.
    let base = match prompt_cache {
        Some(file) => {
            let cached = prompt_cache::load(file, &model, explicit_scheme(kv)?.as_ref())?;
            eprintln!(
                "tessera: prompt cache {}: {} tokens",
                file.display(),
                cached.tokens.first().map_or(0, Vec::len)
            );
            Some(cached)
        }
        None => None,
    };
    let scheme = match &base {
        Some(b) => b.scheme.clone(),
        None => scheme_of(kv)?,
    };
    notice_scheme(&model, &scheme);
    let fresh_session = || -> Result<Session> {
        Ok(match &base {
            Some(b) => Session::with_cache(
                &model,
                &b.scheme,
                b.cache.extract(0)?,
                b.tokens[0].clone(),
                prefill_chunk,
            )?,
            None => Session::new(&model, &scheme, prefill_chunk)?.with_round_slack(spec.slack()),
        })
    };
    let mut session = fresh_session()?;
    // Each turn's drafter reads the conversation anew (a draft model's cache is per
    // generation, as a batch row's is).
    let batch_spec = choice
        .as_ref()
        .map(|c| c.batch_spec(draft.as_ref(), spec.draft_tokens))
        .transpose()?;
    let mut history: Vec<Message> = Vec::new();
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
                history.clear();
                session = fresh_session()?;
                eprintln!("(conversation reset)");
                continue;
            }
            _ => {}
        }
        // Each turn renders the whole conversation; only what the cache lacks is fed.
        history.push(Message::user(line));
        let ids = match template.render(&history, true) {
            Ok(text) => tok.encode(&text, false)?,
            Err(e) => {
                eprintln!("error: {e}");
                history.pop();
                continue;
            }
        };
        // The one reuse rule: the shared prefix, unless the reuse floor or a ring that has
        // overwritten what its window needs again stops it (then the cache starts over).
        let keep = session.reuse_for(&ids).tokens;
        let keep = if keep > 0 && session.truncate(keep).is_ok() {
            keep
        } else {
            session = Session::new(&model, &scheme, prefill_chunk)?.with_round_slack(spec.slack());
            0
        };
        let mut stream = TextStream::new();
        let mut reply = Vec::new();
        let outcome = spec::run(
            &mut session,
            &ids[keep..],
            sampler.clone(),
            max_tokens,
            stops.clone(),
            batch_spec,
            !margs.no_steps_ahead,
            |t| {
                reply.push(t);
                let piece = stream.push(&tok, t)?;
                write!(out, "{piece}")?;
                out.flush()?;
                Ok(())
            },
        );
        if let Err(e) = outcome {
            writeln!(out, "{}", stream.finish())?;
            eprintln!("error: {e} (try /reset)");
            history.pop();
            // The session may hold a partial turn: start the next one over.
            session = fresh_session()?;
            continue;
        }
        writeln!(out, "{}", stream.finish())?;
        history.push(Message::assistant(tok.decode(&reply)?));
    }
}

/// `tessera cache save`: prefill `prompt` (with BOS, as generate encodes it) and write its
/// cache in the flags' scheme to `out`.
pub fn cache_save(
    margs: &ModelArgs,
    prompt: &str,
    out: &Path,
    kv: &KvArgs,
    prefill_chunk: usize,
) -> Result<()> {
    let scheme = scheme_of(kv)?;
    if out.is_dir() {
        bail!("--out {} is a directory; give a file name", out.display());
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            bail!("--out: no directory {}", dir.display());
        }
    }
    let (model, tok) = load(margs)?;
    notice_scheme(&model, &scheme);
    let ids = tok.encode(prompt, true)?;
    let mut session = Session::new(&model, &scheme, prefill_chunk)?;
    let t = Instant::now();
    session.feed(&ids)?;
    let prefill = t.elapsed();
    let t = Instant::now();
    let bytes = prompt_cache::save(out, &model, std::slice::from_ref(&ids), session.cache())?;
    eprintln!(
        "tessera: prefilled {} tokens in {:.2} s; wrote {:.2} MiB in {:.0} ms",
        ids.len(),
        prefill.as_secs_f64(),
        bytes as f64 / 1048576.0,
        t.elapsed().as_secs_f64() * 1e3
    );
    println!(
        "{}: {} tokens, kv {}, {bytes} bytes",
        out.display(),
        ids.len(),
        scheme_label(kv)
    );
    Ok(())
}

/// `tessera cache info FILE`: what the header says, without reading the planes.
pub fn cache_info(file: &Path, json: bool) -> Result<()> {
    let (h, bytes) = prompt_cache::read_header(file)?;
    let rows: Vec<usize> = h.tokens.iter().map(Vec::len).collect();
    let layers = h.layer_summary();
    if json {
        let plane_bytes: usize = h
            .layers
            .iter()
            .flat_map(|l| &l.buffers)
            .map(|b| b.bytes)
            .sum();
        println!(
            "{}",
            serde_json::json!({
                "file": file.display().to_string(), "bytes": bytes, "plane_bytes": plane_bytes,
                "format": h.format, "version": h.version, "writer": h.writer,
                "architecture": h.model.architecture, "layers": h.model.layers,
                "fingerprint": h.model.fingerprint, "rows": rows,
                "minimum_reusable_offset": h.minimum_reusable_offset,
                "signatures": layers.iter().map(|(s, n)| serde_json::json!({"signature": s, "layers": n})).collect::<Vec<_>>(),
            })
        );
        return Ok(());
    }
    println!("file:          {} ({bytes} bytes)", file.display());
    println!(
        "format:        {} version {} (written by tessera {})",
        h.format, h.version, h.writer
    );
    println!(
        "model:         {}, {} layers, fingerprint {}",
        h.model.architecture, h.model.layers, h.model.fingerprint
    );
    println!("rows:          {} (tokens {rows:?})", rows.len());
    println!(
        "reuse floor:   {}",
        match h.minimum_reusable_offset {
            None => "none".to_string(),
            Some(tessera_kv::NEVER_REUSED) => format!(
                "never (a quantized codec fitted on a prompt shorter than {})",
                tessera_kv::FIRST_APPEND
            ),
            Some(f) => f.to_string(),
        }
    );
    for (signature, n) in layers {
        println!("layers:        {n} × {signature}");
    }
    Ok(())
}

/// `tessera serve`'s own flags.
pub struct ServeArgs {
    pub host: String,
    pub port: u16,
    pub max_batch: usize,
    pub kv_budget_mib: Option<usize>,
    pub max_queue: usize,
    pub prefix_cache_mib: usize,
    pub prompt_cache_dir: Option<PathBuf>,
    pub prefill_chunk: usize,
    pub api_key: Option<String>,
    pub spec: SpecArgs,
    /// false: no decode step runs ahead of its tokens (`Batch::with_steps_ahead`).
    pub steps_ahead: bool,
}

pub fn serve(margs: &ModelArgs, kv: &KvArgs, args: ServeArgs) -> Result<()> {
    let choice = args.spec.choice()?;
    if let Some(spec::SpecChoice::Model(p)) = &choice {
        // Named before the model loads, as every other bad flag is.
        resolve_model(Some(p), "--draft-model")?;
    }
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    if args.max_queue == 0 {
        bail!("--max-queue must be at least 1");
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        bail!("--api-key must not be empty");
    }
    if let Some(dir) = &args.prompt_cache_dir {
        if args.prefix_cache_mib == 0 {
            bail!(
                "--prompt-cache-dir needs --prefix-cache MiB (above 0): the folder mirrors \
                 the prefix store, whose budget that is"
            );
        }
        if dir.exists() && !dir.is_dir() {
            bail!("--prompt-cache-dir {} is not a folder", dir.display());
        }
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create --prompt-cache-dir {}", dir.display()))?;
    }
    let scheme = scheme_of(kv)?;
    let path = model_path(margs)?;
    let (model, tok) = load(margs)?;
    notice_scheme(&model, &scheme);
    let max_draft = args.spec.draft_tokens;
    let spec = match &choice {
        None => None,
        Some(choice) => {
            let drafting = match (choice, choice.load(margs, &tok)?) {
                (spec::SpecChoice::Ngram(d), _) => Drafting::Ngram(d.n),
                (_, Some(draft)) => Drafting::Model(Box::new(draft.model)),
                (spec::SpecChoice::Model(p), None) => {
                    bail!("the draft model {} did not load", p.display())
                }
            };
            Some(ServeSpec {
                drafting,
                max_draft,
            })
        }
    };
    // A model whose template does not compile still serves completions.
    let template = match chat_template(&tok) {
        Ok(t) => Some(t),
        Err(e) => {
            eprintln!("note: /v1/chat/completions is off: {e:#}");
            None
        }
    };
    let model_name = match &margs.model {
        Some(m) if !m.exists() => m.display().to_string(),
        _ => path.file_stem().map_or_else(
            || path.display().to_string(),
            |s| s.to_string_lossy().into(),
        ),
    };
    let limits = tessera_engine::BatchLimits {
        max_batch: args.max_batch,
        kv_budget: args.kv_budget_mib.map(|m| m.saturating_mul(1 << 20)),
        max_queue: args.max_queue,
    };
    // Refuse bad limits before listening.
    {
        let probe = tessera_engine::Batch::new(&model, &scheme, args.prefill_chunk, limits)?;
        if let Some(spec) = &spec {
            probe.with_speculation(spec.batch_spec())?;
        }
    }
    let config = tessera_server::ServerConfig {
        host: args.host,
        port: args.port,
        model_name,
        api_key: args.api_key,
        engine: tessera_server::engine::EngineParts {
            model,
            tokenizer: tok,
            scheme,
            prefill_chunk: args.prefill_chunk,
            limits,
            prefix_cache: args.prefix_cache_mib.saturating_mul(1 << 20),
            prompt_cache_dir: args.prompt_cache_dir,
            chat_template: template,
            spec,
            steps_ahead: args.steps_ahead,
        },
    };
    Ok(tessera_server::serve(config)?)
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

/// `tessera eval --prompt-cache FILE`: the prefix the text shares with the cached prompt is
/// not prefilled again; the next `tokens` tokens are decoded one at a time and scored.
pub fn eval_prompt_cache(
    margs: &ModelArgs,
    text: &Path,
    file: &Path,
    kv: &Option<String>,
    kv_start: usize,
    tokens: usize,
    json: bool,
) -> Result<()> {
    if kv.as_deref().is_some_and(|k| k.contains(',')) {
        bail!("--prompt-cache evaluates the one scheme of its file: give at most one --kv");
    }
    if tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    let body = std::fs::read_to_string(text)
        .with_context(|| format!("cannot read text file {}", text.display()))?;
    let kv_args = KvArgs {
        kv: kv.clone(),
        kv_start,
        kv_config: None,
    };
    let (model, tok) = load(margs)?;
    let ids = tok.encode(&body, true)?;
    let (held, _) = prompt_cache::read_header(file)?;
    let held = held.tokens.first().map_or(0, Vec::len);
    // Resumed at most one short of the cached prompt: feeding the next token gives the
    // logits that predict the first scored one.
    let until = held.min(ids.len());
    let (mut session, reused, scheme) = open_session(
        &model,
        &kv_args,
        &ids[..until],
        DEFAULT_PREFILL_CHUNK,
        Some(file),
        0,
    )?;
    if reused == 0 {
        bail!("the text shares no reusable prefix with the cached prompt of {held} tokens");
    }
    let start = reused + 1;
    let end = (start + tokens).min(ids.len());
    if end <= start {
        bail!("the text has no tokens after the {reused} it shares with the cached prompt");
    }
    let logits = session.feed(&ids[reused..start])?;
    let t = Instant::now();
    let (ppl, scored) =
        tessera_engine::eval::decode_perplexity(&mut session, logits, &ids[start..end])?;
    let secs = t.elapsed().as_secs_f64();
    let label = kv.clone().unwrap_or_else(|| scheme.to_string());
    if json {
        println!(
            "{}",
            serde_json::json!({"kv": label, "ppl": ppl, "tokens_scored": scored, "cached_tokens": reused,
                "kv_bytes_per_token": session.cache().bytes_per_token()})
        );
    } else {
        println!("{:<16} {:>10} {:>8} {:>8}", "kv", "ppl", "cached", "scored");
        println!("{label:<16} {ppl:>10.4} {reused:>8} {scored:>8}");
        eprintln!("[scored {scored} tokens in {secs:.1} s after {reused} cached]");
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

/// `tessera model fetch [NAME] [--force]`: a registry model (default: the default model).
pub fn fetch(name: Option<&str>, force: bool) -> Result<()> {
    let m = match name {
        Some(n) => store::registry_model(n)?,
        None => store::DEFAULT_MODEL,
    };
    let path = with_progress(|p| {
        if force {
            store::fetch_model(m, p)
        } else {
            store::ensure_model(m, p)
        }
    })?;
    println!("{}", path.display());
    Ok(())
}

/// `tessera model list`: the registry, with sizes and what is in $TESSERA_HOME/models.
pub fn list() -> Result<()> {
    println!("{:<30} {:>9}  {:<11} FILE", "NAME", "SIZE", "STATUS");
    for m in store::REGISTRY {
        let status = if m.is_verified() {
            "present"
        } else if m.is_present() {
            "unverified"
        } else {
            "absent"
        };
        let default = if std::ptr::eq(m, store::DEFAULT_MODEL) {
            "  (default)"
        } else {
            ""
        };
        println!(
            "{:<30} {:>6} MB  {:<11} {}{default}",
            m.name,
            m.bytes.div_ceil(1_000_000),
            status,
            m.path().display()
        );
    }
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
    let path = resolve_model(model, "--model")?;
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
