//! `tessera bench --graph-probe`: decode steps as CUDA graphs at `--depth`, batch 1.
//! First the step graphs the model runs by default (`LoadOptions::step_graphs`: everything
//! but the KV cache's work captured once and replayed) against eager steps: the same greedy
//! tokens and logits, and both timed. Then the ceiling: one whole step's device side (after
//! the host has read the id and uploaded the RoPE tables) captured and replayed; each replay
//! repeats the same step (the same KV slot written, the same positions read), so the figure
//! is the step with all its launches taken off the host.

use crate::commands::{load, scheme_of};
use crate::{KvArgs, ModelArgs};
use anyhow::Result;

#[cfg(not(feature = "cuda"))]
pub fn graph_probe(_: &ModelArgs, _: &KvArgs, _: usize, _: usize, _: bool) -> Result<()> {
    let _ = (load, scheme_of);
    anyhow::bail!("--graph-probe times CUDA graphs: build with `--features cuda`")
}

#[cfg(feature = "cuda")]
pub fn graph_probe(
    margs: &ModelArgs,
    kv: &KvArgs,
    depth: usize,
    steps: usize,
    json: bool,
) -> Result<()> {
    use anyhow::{bail, Context};
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::{Device, Tensor, D};
    use std::time::Instant;
    use tessera_engine::{Session, DEFAULT_PREFILL_CHUNK};
    use tessera_models::LogitsMode;

    let scheme = scheme_of(kv)?;
    let (model, tok) = load(margs)?;
    let Device::Cuda(cuda) = model.device().clone() else {
        bail!("--graph-probe needs --device cuda");
    };
    if steps == 0 || depth + 2 * steps + 8 > model.context_length() {
        bail!("--gen-tokens must be at least 1 and --depth + 2 × it fit the model's context");
    }
    let stream = cuda.cuda_stream();
    let bos = tok.special().bos.unwrap_or(2);
    let context = crate::bench::synthetic_tokens(depth.max(1), model.vocab_size(), bos);
    let mut session = Session::new(&model, &scheme, DEFAULT_PREFILL_CHUNK)?;
    if context.len() > 1 {
        session.feed(&context[..context.len() - 1])?;
    }
    let mut cache = session.cache().extract(0)?;
    let device = model.device();
    let ids = |t: u32| Tensor::from_vec(vec![t], (1, 1), device);
    let argmax = |logits: &Tensor| -> Result<u32> {
        Ok(logits
            .flatten_all()?
            .argmax(D::Minus1)?
            .to_scalar::<u32>()?)
    };

    // The step graphs (`LoadOptions::step_graphs`: everything but the cache's work
    // replayed) against eager steps, each from its own copy of the context: greedy tokens
    // and logits over a few steps (the first captures), then each timed over `steps`.
    let last = context[context.len() - 1];
    let run = |graphs: bool, n: usize, collect: bool| -> Result<Steps> {
        model.set_step_graphs(graphs);
        let mut cache = session.cache().extract(0)?;
        let mut out = Steps::default();
        let mut token = last;
        for i in 0..n + 4 {
            let t = Instant::now();
            let logits = model.forward(&ids(token)?, &mut cache, LogitsMode::Last)?;
            let submitted = t.elapsed().as_secs_f64();
            if collect {
                out.logits.push(logits.flatten_all()?.to_vec1::<f32>()?);
            }
            token = argmax(&logits)?;
            out.tokens.push(token);
            if i >= 4 {
                out.submit += submitted / n as f64;
                out.step += t.elapsed().as_secs_f64() / n as f64;
            }
        }
        Ok(out)
    };
    let compared = steps.min(28);
    let (eager_run, graph_run) = (run(false, compared, true)?, run(true, compared, true)?);
    let same_tokens = eager_run.tokens == graph_run.tokens;
    let logit_diff = eager_run
        .logits
        .iter()
        .zip(&graph_run.logits)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0f32, f32::max);
    let (graphs_timed, eager_timed) = (run(true, steps, false)?, run(false, steps, false)?);
    if !json {
        println!(
            "step graphs | kv {} | depth {depth} | {compared} steps: tokens the same as eager: {same_tokens}, largest logit difference {logit_diff:e}",
            crate::commands::scheme_label(kv)
        );
        for (name, r) in [("eager", &eager_timed), ("graphs", &graphs_timed)] {
            println!(
                "{name:>6}  step {:.3} ms ({:.1} tok/s), {:.3} of them submitting",
                1e3 * r.step,
                1.0 / r.step,
                1e3 * r.submit
            );
        }
    }
    model.set_step_graphs(false);

    // The ceiling: one whole step's device side captured, the host side (the id, the RoPE
    // tables) outside the capture. The eager steps to compare with are `eager_timed`.
    let input = model.prepare(&ids(last)?, &cache)?;
    stream.synchronize()?;
    let t = Instant::now();
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured = model.forward_prepared(&input, &mut cache, LogitsMode::Last);
    let capture = t.elapsed().as_secs_f64();
    // An allocation the graph makes and does not free (the logits) is freed by its next
    // launch; the last one's by dropping `logits` after the replays.
    let ended = stream.end_capture(
        sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
    );
    let instantiate = t.elapsed().as_secs_f64() - capture;
    let logits = captured.context("the step under capture")?;
    let graph = ended
        .context("ending the capture and instantiating the graph")?
        .context("the capture recorded no graph")?;
    let mut nodes = 0usize;
    // SAFETY: counts the nodes of a live graph (a null array asks only for the count).
    unsafe {
        sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes).result()?;
    }
    graph.upload()?;
    graph.launch()?;
    let first = argmax(&logits)?;

    // Replays back to back: the device's time for the step.
    stream.synchronize()?;
    let t = Instant::now();
    for _ in 0..steps {
        graph.launch()?;
    }
    stream.synchronize()?;
    let replay = t.elapsed().as_secs_f64() / steps as f64;
    // Replays each followed by the id's readback, as a decode loop takes them.
    let t = Instant::now();
    let mut same = true;
    for _ in 0..steps {
        graph.launch()?;
        same &= argmax(&logits)? == first;
    }
    let replay_read = t.elapsed().as_secs_f64() / steps as f64;
    drop(logits);
    drop(graph);
    stream.synchronize()?;
    let ms = |s: f64| 1e3 * s;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "depth": depth, "steps": steps, "kv": crate::commands::scheme_label(kv),
                "capture_ms": ms(capture), "instantiate_ms": ms(instantiate), "graph_nodes": nodes,
                "replay_ms": ms(replay), "replay_readback_ms": ms(replay_read),
                "replays_agree": same,
                "step_graphs": {"compared_steps": compared, "same_tokens": same_tokens, "largest_logit_difference": logit_diff,
                    "eager_step_ms": ms(eager_timed.step), "eager_submit_ms": ms(eager_timed.submit),
                    "graphs_step_ms": ms(graphs_timed.step), "graphs_submit_ms": ms(graphs_timed.submit)},
            })
        );
    } else {
        println!(
            "graph probe | kv {} | depth {depth} | {nodes} nodes (capture {:.2} ms, instantiate {:.2} ms)",
            crate::commands::scheme_label(kv),
            ms(capture),
            ms(instantiate)
        );
        println!(
            "replayed step {:.3} ms back to back ({:.1} tok/s), {:.3} ms with the id read back each ({:.1} tok/s); replays agree: {same}",
            ms(replay),
            1.0 / replay,
            ms(replay_read),
            1.0 / replay_read
        );
    }
    Ok(())
}

/// A run of decode steps: each step's greedy token (and logits, where collected), and the
/// mean submit and step time of the steps after the warm-up.
#[cfg(feature = "cuda")]
#[derive(Default)]
struct Steps {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    submit: f64,
    step: f64,
}
