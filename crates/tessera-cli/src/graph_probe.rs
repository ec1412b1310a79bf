//! `tessera bench --graph-probe`: what a CUDA graph of the decode step would save. One
//! batch-1 decode step at `--depth` is captured (the device side of the forward, after the
//! host has read the id and uploaded the RoPE tables) and replayed; each replay repeats the
//! same step (the same KV slot written, the same positions read), so the figure is the
//! step's time with the host's launches taken away: its GPU-bound floor, against the eager
//! steps timed before it.

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

    // Eager steps, as `Batch::step_rows` takes them: a warm-up, then `steps` timed.
    let mut token = context[context.len() - 1];
    let (mut submit, mut eager) = (0.0, 0.0);
    for i in 0..steps + 4 {
        let t = Instant::now();
        let logits = model.forward(&ids(token)?, &mut cache, LogitsMode::Last)?;
        let submitted = t.elapsed().as_secs_f64();
        token = argmax(&logits)?;
        if i >= 4 {
            submit += submitted;
            eager += t.elapsed().as_secs_f64();
        }
    }
    let (submit, eager) = (submit / steps as f64, eager / steps as f64);
    if !json {
        eprintln!("eager steps timed; capturing");
    }

    // One step captured: the host side first, outside the capture. A capture that fails
    // with programmatic launches is tried once more without them.
    let attempt = |cache: &mut tessera_kv::KvCache, token: u32| -> Result<_> {
        let input = model.prepare(&ids(token)?, cache)?;
        stream.synchronize()?;
        let t = Instant::now();
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = model.forward_prepared(&input, cache, LogitsMode::Last);
        let capture = t.elapsed().as_secs_f64();
        // An allocation the graph makes and does not free (the logits) is freed by its
        // next launch; the last one's by dropping `logits` after the replays.
        let ended = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        let instantiate = t.elapsed().as_secs_f64() - capture;
        let logits = captured.context("the step under capture")?;
        let graph = ended
            .context("ending the capture and instantiating the graph")?
            .context("the capture recorded no graph")?;
        Ok((graph, logits, capture, instantiate))
    };
    let mut programmatic = true;
    let (graph, logits, capture, instantiate) = match attempt(&mut cache, token) {
        Ok(g) => g,
        Err(e) => {
            println!("capture with programmatic launches failed: {e:#}");
            let _ = stream.synchronize();
            tessera_kernels::set_programmatic(false);
            programmatic = false;
            for _ in 0..2 {
                let logits = model.forward(&ids(token)?, &mut cache, LogitsMode::Last)?;
                token = argmax(&logits)?;
            }
            attempt(&mut cache, token).context("the capture without programmatic launches")?
        }
    };
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
    stream.synchronize()?;

    // Steps captured afresh each time (the host's walk recorded, not launched) and the
    // instantiated graph updated to each: llama.cpp's way, which keeps the walk.
    let (mut updated, mut update_error) = (0usize, None);
    let t = Instant::now();
    for _ in 0..steps {
        let input = model.prepare(&ids(token)?, &cache)?;
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let out = model.forward_prepared(&input, &mut cache, LogitsMode::Last);
        let mut g: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above on this stream; `g` is destroyed below.
        let ended = unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut g) };
        if ended != sys::CUresult::CUDA_SUCCESS {
            let step = out.err().map(|e| format!("{e:#}"));
            update_error = Some(format!("ending the capture: {ended:?}; the step: {step:?}"));
            break;
        }
        let logits = match out {
            Ok(l) => l,
            Err(e) => {
                // SAFETY: `g` came from the capture and is not used again.
                unsafe { sys::cuGraphDestroy(g).result()? };
                update_error = Some(format!("the step under capture: {e:#}"));
                break;
            }
        };
        // SAFETY: a zeroed result record is a valid out-parameter.
        let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
        // SAFETY: both handles are live; the exec is not running (stream synchronized by the
        // last readback).
        let r = unsafe { sys::cuGraphExecUpdate_v2(graph.cu_graph_exec(), g, &mut info) };
        // SAFETY: `g` came from the capture and is not used again.
        unsafe { sys::cuGraphDestroy(g).result()? };
        if r != sys::CUresult::CUDA_SUCCESS {
            update_error = Some(format!("{r:?} ({:?})", info.result));
            std::mem::forget(logits);
            break;
        }
        graph.launch()?;
        token = argmax(&logits)?;
        drop(logits);
        updated += 1;
    }
    let update = t.elapsed().as_secs_f64() / updated.max(1) as f64;
    drop(graph);
    stream.synchronize()?;
    let ms = |s: f64| 1e3 * s;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "depth": depth, "steps": steps, "kv": crate::commands::scheme_label(kv),
                "eager_step_ms": ms(eager), "eager_submit_ms": ms(submit),
                "capture_ms": ms(capture), "instantiate_ms": ms(instantiate), "graph_nodes": nodes,
                "replay_ms": ms(replay), "replay_readback_ms": ms(replay_read),
                "replays_agree": same, "programmatic": programmatic, "updated_steps": updated, "updated_step_ms": ms(update),
                "update_error": update_error,
            })
        );
    } else {
        println!(
            "graph probe | kv {} | depth {depth} | {nodes} nodes (capture {:.2} ms, instantiate {:.2} ms) | programmatic launches {programmatic}",
            crate::commands::scheme_label(kv),
            ms(capture),
            ms(instantiate)
        );
        println!(
            "eager    step {:.3} ms ({:.1} tok/s), {:.3} of them submitting",
            ms(eager),
            1.0 / eager,
            ms(submit)
        );
        println!(
            "replayed step {:.3} ms back to back ({:.1} tok/s), {:.3} ms with the id read back each ({:.1} tok/s); replays agree: {same}",
            ms(replay),
            1.0 / replay,
            ms(replay_read),
            1.0 / replay_read
        );
        match &update_error {
            None => println!(
                "recaptured and updated step {:.3} ms ({:.1} tok/s, {updated} steps)",
                ms(update),
                1.0 / update
            ),
            Some(e) => println!("recapture + cuGraphExecUpdate refused after {updated} steps: {e}"),
        }
    }
    Ok(())
}
