//! Steps run ahead on ids chosen where the logits lie (`Model::choose_greedy` →
//! `ChosenIds`, `Model::forward_chosen`, the path a GPU takes), on the CPU through a
//! stand-in graph backend: its `greedy_ids` picks each row's token by the engine's argmax
//! and hands over the ids as a tensor and a host copy, and it refuses every capture, so the
//! steps themselves stay eager. Requests that join at different steps, end on `max_tokens`
//! and on a stop token (so the chosen ids are filtered as rows leave) decode what each
//! decodes alone. The CUDA kernel itself is checked on the device (`tessera bench`'s tokens
//! digest with and without `--no-steps-ahead`).

mod common;

use candle_core::{Device, Result, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tessera_engine::{
    Batch, BatchLimits, Event, GenerationRequest, SamplerConfig, Session, StopReason,
};
use tessera_kv::KvScheme;
use tessera_models::step_graph::{install, DeviceGraph, GraphBackend, HostIds};

struct StandIn {
    picks: Arc<AtomicUsize>,
}

struct Ready(Vec<u32>);

impl HostIds for Ready {
    fn wait(self: Box<Self>) -> Result<Vec<u32>> {
        Ok(self.0)
    }
}

impl GraphBackend for StandIn {
    fn serves(&self, device: &Device) -> bool {
        device.is_cpu()
    }
    fn begin(&self, _: &Device) -> Result<()> {
        candle_core::bail!("no captures in the stand-in")
    }
    fn end(&self, _: &Device) -> Result<Box<dyn DeviceGraph>> {
        candle_core::bail!("no captures in the stand-in")
    }
    fn greedy_ids(&self, logits: &Tensor) -> Result<Option<(Tensor, Box<dyn HostIds>)>> {
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        let ids: Vec<u32> = rows.iter().map(|r| tessera_engine::argmax(r)).collect();
        self.picks.fetch_add(1, Ordering::SeqCst);
        let tensor = Tensor::from_vec(ids.clone(), (ids.len(), 1), logits.device())?;
        Ok(Some((tensor, Box::new(Ready(ids)))))
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize, stop_tokens: Vec<u32>) -> GenerationRequest {
    GenerationRequest {
        prompt,
        max_tokens,
        sampler: SamplerConfig::default(),
        stop_tokens,
        logprobs: None,
        stop_strings: Vec::new(),
    }
}

#[test]
fn steps_run_ahead_on_chosen_ids_decode_what_each_request_decodes_alone() {
    let picks = Arc::new(AtomicUsize::new(0));
    install(Box::new(StandIn {
        picks: picks.clone(),
    }));
    let (model, tok) = common::load_f32_weights();
    let scheme = KvScheme::parse("affine:4").unwrap();
    let chars: Vec<char> = common::corpus().chars().collect();
    let prompts: Vec<Vec<u32>> = [(9000, 40), (500, 30), (31000, 220)]
        .iter()
        .map(|&(at, len)| {
            tok.encode(&chars[at..at + len].iter().collect::<String>(), true)
                .unwrap()
        })
        .collect();
    let max_tokens = [30usize, 24, 20];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&max_tokens)
        .map(|(p, &m)| {
            let mut session = Session::new(&model, &scheme, 64).unwrap();
            common::decode_alone(&mut session, p, SamplerConfig::default(), m)
        })
        .collect();
    // Request 0, the first row, stops on a token it first makes at its seventh or later,
    // while all three run ahead: the last row then takes its place, and the chosen ids
    // must follow.
    let stop_at = (6..max_tokens[0])
        .find(|&k| !alone[0][..k].contains(&alone[0][k]))
        .unwrap_or_else(|| panic!("no token first made late in {:?}", alone[0]));
    let stop = alone[0][stop_at];
    let requests = [
        request(prompts[0].clone(), max_tokens[0], vec![stop]),
        request(prompts[1].clone(), max_tokens[1], vec![]),
        request(prompts[2].clone(), max_tokens[2], vec![]),
    ];
    let join_at = [0, 0, 2];
    let mut batch = Batch::new(&model, &scheme, 64, BatchLimits::default())
        .unwrap()
        .with_steps_ahead(true);
    let (out, mut events, _) = common::run_batch(&mut batch, &requests, &join_at, None);
    assert!(batch.times().steps_ahead > 5, "{:?}", batch.times());
    assert!(
        picks.load(Ordering::SeqCst) > 5,
        "the stand-in chose the ids"
    );
    assert_eq!(
        out[0],
        alone[0][..stop_at],
        "request 0 up to its stop token"
    );
    assert_eq!(out[1], alone[1], "request 1");
    assert_eq!(out[2], alone[2], "request 2");
    for (i, want) in [
        (0, StopReason::EndToken),
        (1, StopReason::MaxTokens),
        (2, StopReason::MaxTokens),
    ] {
        match events[i].take() {
            Some(Event::Finished {
                reason,
                completion_tokens,
                ..
            }) => {
                assert_eq!(reason, want, "request {i}");
                assert_eq!(completion_tokens, out[i].len(), "request {i}");
            }
            other => panic!("request {i} ended with {other:?}"),
        }
    }
}
