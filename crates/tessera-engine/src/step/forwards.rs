//! The forwards a step runs: prompts read (several whole ones together, or one chunk of
//! one), decode steps (plain, run ahead of their tokens, or a speculative round verifying
//! every row's draft).

use super::admission::Waiting;
use super::ahead::Ahead;
use super::output::Row;
use super::request::Event;
use super::Batch;
use crate::sequence::Sequence;
use crate::speculative::Draft;
use crate::stop::StopReason;
use crate::EngineError;
use candle_core::Tensor;
use std::time::Instant;
use tessera_kv::KvCache;
use tessera_models::LogitsMode;

impl<'m> Batch<'m> {
    /// Reads several waiting prompts in one forward (see [`Batch::group_size`]): each row
    /// left-padded to the widest, so every row's last position is its prompt's last token.
    /// Each samples its first token and joins the running batch. Returns whether it read
    /// any; on an error the prompts go back to the front of the queue.
    pub(super) fn prefill_group(&mut self, events: &mut Vec<Event>) -> Result<bool, EngineError> {
        let Some((take, width)) = self.group_size() else {
            return Ok(false);
        };
        let pads: Vec<usize> = self
            .waiting
            .iter()
            .take(take)
            .map(|w| width - w.request.prompt.len())
            .collect();
        let mut cache = KvCache::new(&self.model.layer_specs(), &self.scheme, pads.clone())?
            .with_isa(self.model.isa())
            .with_round_slack(self.round_slack());
        if cache.max_append_tokens().is_some_and(|m| m < width) {
            // The prompts would cross a bf16-first transition: read one at a time.
            return Ok(false);
        }
        let group: Vec<Waiting> = self.waiting.drain(..take).collect();
        let mut ids = Vec::with_capacity(take * width);
        for (w, &pad) in group.iter().zip(&pads) {
            // Padding: read, masked from every real position, never sampled from.
            ids.extend(std::iter::repeat_n(w.request.prompt[0], pad));
            ids.extend_from_slice(&w.request.prompt);
        }
        let started = Instant::now();
        let logits = Tensor::from_vec(ids, (take, width), self.model.device())
            .map_err(EngineError::from)
            .and_then(|ids| Ok(self.model.forward(&ids, &mut cache, LogitsMode::Last)?))
            .and_then(|l| {
                self.times.prefill_submit += started.elapsed();
                Ok(l.flatten_all()?.to_vec1::<f32>()?)
            });
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                for w in group.into_iter().rev() {
                    self.waiting.push_front(w);
                }
                return Err(e);
            }
        };
        let vocab = logits.len() / take;
        self.times.prefill_tokens += width * take - pads.iter().sum::<usize>();
        self.times.prefill_forwards += 1;
        let mut joining = Vec::new();
        let mut left = Vec::new();
        for (i, w) in group.into_iter().enumerate() {
            let kv_bytes = self.kv_bytes_for(width + w.request.max_tokens);
            let mut row = self.new_row(w.id, w.request, 0, kv_bytes);
            match row.take(&logits[i * vocab..(i + 1) * vocab], self.tokenizer, events) {
                Some(reason) => {
                    events.push(row.finished(reason));
                    left.push((i, row));
                }
                None => joining.push((i, row)),
            }
        }
        for (i, row) in &left {
            let tokens = row.history[..row.prompt_tokens].to_vec();
            self.leave(row.id, tokens, cache.extract(*i)?)?;
        }
        if !joining.is_empty() {
            if !left.is_empty() {
                cache.filter(&joining.iter().map(|(i, _)| *i).collect::<Vec<_>>())?;
            }
            self.times.prefill += started.elapsed();
            self.join(cache)?;
            self.rows.extend(joining.into_iter().map(|(_, row)| row));
            return Ok(true);
        }
        self.times.prefill += started.elapsed();
        Ok(true)
    }
    /// Reads one chunk of the prompt being prefilled (ending where the KV transition
    /// converts, as a single session's prefill does); when the prompt is read, samples its
    /// first token and moves its row into the running batch.
    pub(super) fn prefill_chunk(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let Some(p) = self.prefill.as_mut() else {
            return Ok(());
        };
        let rest = p.request.prompt.len() - p.fed;
        let mut len = crate::session::chunk_len(&p.cache, self.prefill_chunk, rest);
        // A checkpoint inside a transition's first append is not made: that row's codec
        // would be fitted on fewer positions than any fresh row's.
        if p.cache.first_append().is_some() && p.checkpoint.is_some_and(|c| c < len) {
            p.checkpoint = None;
        }
        if let Some(c) = p.checkpoint.filter(|&c| p.fed < c) {
            len = len.min(c - p.fed);
        }
        let started = Instant::now();
        let chunk = &p.request.prompt[p.fed..p.fed + len];
        let ids = Tensor::from_slice(chunk, (1, len), self.model.device())?;
        let logits = self.model.forward(&ids, &mut p.cache, LogitsMode::Last)?;
        self.times.prefill_submit += started.elapsed();
        p.fed += len;
        self.times.prefill_tokens += len;
        self.times.prefill_forwards += 1;
        if p.checkpoint == Some(p.fed) {
            if let Some(store) = self.prefixes.as_mut() {
                let tokens = p.request.prompt[..p.fed].to_vec();
                store.insert(Sequence::new(tokens, p.cache.extract(0)?)?);
            }
        }
        if p.fed < p.request.prompt.len() {
            // Not waited for: on a GPU the next chunk is submitted while this one runs (the
            // last chunk's read-back waits for all of them).
            self.times.prefill += started.elapsed();
            return Ok(());
        }
        let Some(p) = self.prefill.take() else {
            return Ok(());
        };
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let mut row = self.new_row(p.id, p.request, p.cached, p.kv_bytes);
        let first = row.take(&logits, self.tokenizer, events);
        self.times.prefill += started.elapsed();
        if let Some(reason) = first {
            events.push(row.finished(reason));
            self.leave(row.id, row.history[..row.prompt_tokens].to_vec(), p.cache)?;
            return Ok(());
        }
        self.join(p.cache)?;
        self.rows.push(row);
        Ok(())
    }

    /// Appends `cache`'s rows to the running batch.
    pub(super) fn join(&mut self, cache: KvCache) -> Result<(), EngineError> {
        let started = Instant::now();
        // A refused join leaves the running rows as they were.
        let joined = match self.running.as_mut() {
            None => {
                self.running = Some(cache);
                Ok(())
            }
            Some(running) => running.extend(cache),
        };
        self.times.rows += started.elapsed();
        self.times.row_moves += 1;
        Ok(joined?)
    }

    /// One token for every running row (with speculation, each row's accepted drafts and
    /// one token more); rows that finish leave the batch.
    pub(super) fn decode(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let Some(cache) = self.running.as_mut() else {
            return Ok(());
        };
        // A row whose context is full ends before the forward.
        let context = self.model.context_length();
        let offsets = cache.offsets();
        let mut done: Vec<usize> = Vec::new();
        for (i, row) in self.rows.iter_mut().enumerate() {
            if offsets[i] + 1 > context {
                events.push(row.finished(StopReason::ContextLimit));
                done.push(i);
            }
        }
        if done.is_empty() {
            if self.keeps_ahead() {
                self.step_ahead(events, &mut done)?;
                return self.remove_rows(&done);
            }
            let drafts = self.drafts(&offsets, events, &mut done);
            if drafts.iter().all(|d| d.tokens.is_empty()) {
                self.step_rows(events, &mut done)?;
            } else {
                self.verify_drafts(&drafts, events, &mut done)?;
            }
        }
        self.remove_rows(&done)
    }

    /// One plain decode step: every row's next token read, one token sampled per row.
    pub(super) fn step_rows(
        &mut self,
        events: &mut Vec<Event>,
        done: &mut Vec<usize>,
    ) -> Result<(), EngineError> {
        let Some(cache) = self.running.as_mut() else {
            return Ok(());
        };
        let started = Instant::now();
        let ids: Vec<u32> = self.rows.iter().map(|r| r.next).collect();
        let ids = Tensor::from_vec(ids, (self.rows.len(), 1), self.model.device())?;
        let logits = self
            .model
            .forward(&ids, cache, LogitsMode::Last)?
            .squeeze(1)?;
        let tokenizer = self.tokenizer;
        if self.rows.iter().all(Row::plain_greedy) {
            // Only the chosen ids come back from the device, not the rows' logits (a
            // megabyte per row at Gemma's vocabulary). Ties go to the lowest id, as the
            // sampler's greedy choice.
            self.times.decode_submit += started.elapsed();
            let tokens = crate::sampler::argmax_rows(&logits)?;
            for (i, (row, &t)) in self.rows.iter_mut().zip(&tokens).enumerate() {
                if done.contains(&i) {
                    continue;
                }
                if let Some(reason) = row.take_chosen(t, tokenizer, events) {
                    events.push(row.finished(reason));
                    done.push(i);
                }
            }
        } else {
            self.times.decode_submit += started.elapsed();
            let logits: Vec<Vec<f32>> = logits.to_vec2()?;
            for (i, (row, l)) in self.rows.iter_mut().zip(&logits).enumerate() {
                if done.contains(&i) {
                    continue;
                }
                if let Some(reason) = row.take(l, tokenizer, events) {
                    events.push(row.finished(reason));
                    done.push(i);
                }
            }
        }
        self.times.decode += started.elapsed();
        self.times.decode_steps += 1;
        self.times.decode_rows += self.rows.len();
        if self.spec.is_some() {
            // Per row, as in a round: a row decoded without a draft.
            self.spec_stats.plain_steps += self.rows.len();
        }
        Ok(())
    }

    /// Whether this step runs ahead of its tokens ([`Batch::with_steps_ahead`]).
    pub(super) fn keeps_ahead(&self) -> bool {
        let Some(cache) = self.running.as_ref() else {
            return false;
        };
        if !self.steps_ahead
            || self.rows.is_empty()
            || self.spec.is_some()
            || self.prefixes.is_some()
            || !self.cancelled.is_empty()
            || !self.waiting.is_empty()
            || self.prefill.is_some()
        {
            return false;
        }
        // The step decides each row's token after those of the step still ahead: it must
        // be one the row may produce, in its context.
        let pending = usize::from(self.ahead.is_some());
        let context = self.model.context_length();
        self.rows.iter().zip(cache.offsets()).all(|(r, end)| {
            r.plain_greedy() && r.produced + pending < r.max_tokens && end < context
        })
    }

    /// One greedy step run ahead: its forward queued on the previous step's ids (as the
    /// device holds them where it chose them), its own ids chosen, and then the previous
    /// step's tokens taken by the rows.
    pub(super) fn step_ahead(
        &mut self,
        events: &mut Vec<Event>,
        done: &mut Vec<usize>,
    ) -> Result<(), EngineError> {
        let Some(cache) = self.running.as_mut() else {
            return Ok(());
        };
        let started = Instant::now();
        let previous = self.ahead.take();
        let logits = match previous.as_ref().and_then(|a| a.chosen.as_ref()) {
            Some(chosen) => self.model.forward_chosen(chosen, cache, LogitsMode::Last)?,
            None => {
                let ids = match previous.as_ref().and_then(Ahead::here) {
                    Some(ids) => ids,
                    None => self.rows.iter().map(|r| r.next).collect(),
                };
                let ids = Tensor::from_vec(ids, (self.rows.len(), 1), self.model.device())?;
                self.model.forward(&ids, cache, LogitsMode::Last)?
            }
        }
        .squeeze(1)?;
        let rows = self.rows.iter().map(|r| r.id).collect();
        let chosen = self.model.choose_greedy(&logits)?;
        let next = Ahead::new(rows, chosen, || Ok(crate::sampler::argmax_rows(&logits)?))?;
        self.times.decode_submit += started.elapsed();
        if let Some(previous) = previous {
            self.take_ahead(previous, events, done)?;
        }
        self.ahead = Some(next);
        self.times.decode += started.elapsed();
        self.times.decode_steps += 1;
        self.times.steps_ahead += 1;
        self.times.decode_rows += self.rows.len();
        Ok(())
    }

    /// The rows take the tokens of the step run ahead; those that end are put in `done`.
    pub(super) fn take_ahead(
        &mut self,
        ahead: Ahead,
        events: &mut Vec<Event>,
        done: &mut Vec<usize>,
    ) -> Result<(), EngineError> {
        if ahead.rows.len() != self.rows.len()
            || ahead.rows.iter().zip(&self.rows).any(|(&id, r)| id != r.id)
        {
            return Err(EngineError::Invalid(
                "a step run ahead holds other rows than the batch".into(),
            ));
        }
        let tokens = ahead.wait()?;
        let tokenizer = self.tokenizer;
        for (i, (row, &t)) in self.rows.iter_mut().zip(&tokens).enumerate() {
            if let Some(reason) = row.take_chosen(t, tokenizer, events) {
                events.push(row.finished(reason));
                done.push(i);
            }
        }
        Ok(())
    }

    /// Takes the tokens of the step run ahead, if any; rows that end with them leave.
    pub(super) fn settle_ahead(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let Some(ahead) = self.ahead.take() else {
            return Ok(());
        };
        let started = Instant::now();
        let mut done = Vec::new();
        self.take_ahead(ahead, events, &mut done)?;
        self.times.decode += started.elapsed();
        self.remove_rows(&done)
    }

    /// Each running row's draft from its own drafter (empty without speculation or without
    /// a match): never more tokens than the row may still produce, and every row's chunk
    /// inside the context. A row whose drafter fails ends with that failure (in `done`).
    pub(super) fn drafts(
        &mut self,
        offsets: &[usize],
        events: &mut Vec<Event>,
        done: &mut Vec<usize>,
    ) -> Vec<Draft> {
        let context = self.model.context_length();
        // The chunk is as wide for every row: it must fit the fullest row's context.
        let room = offsets
            .iter()
            .map(|&o| context.saturating_sub(o + 1))
            .min()
            .unwrap_or(0);
        let mut drafts = Vec::with_capacity(self.rows.len());
        for (i, row) in self.rows.iter_mut().enumerate() {
            let Some(drafter) = row.drafter.as_mut() else {
                drafts.push(Draft::default());
                continue;
            };
            let k = row
                .draft_len
                .next()
                .min(row.max_tokens.saturating_sub(row.produced + 1))
                .min(room);
            let drafted = if k == 0 {
                Ok(Draft::default())
            } else {
                drafter.draft(&row.history, k)
            };
            match drafted {
                Ok(mut draft) => {
                    draft.tokens.truncate(k);
                    draft.q.truncate(k);
                    drafts.push(draft);
                }
                Err(e) => {
                    row.failure = Some(format!("drafting failed: {e}"));
                    events.push(row.finished(StopReason::EndToken));
                    done.push(i);
                    drafts.push(Draft::default());
                }
            }
        }
        drafts
    }

    /// One speculative round over the running batch: every row reads its next token and
    /// its draft (padded to the widest draft) as one chunk inside a round; each row keeps
    /// the drafts its sampler accepts and one token more, and the round rolls every row
    /// back to what it kept.
    pub(super) fn verify_drafts(
        &mut self,
        drafts: &[Draft],
        events: &mut Vec<Event>,
        done: &mut Vec<usize>,
    ) -> Result<(), EngineError> {
        let Some(cache) = self.running.as_mut() else {
            return Ok(());
        };
        let rows = self.rows.len();
        let width = 1 + drafts.iter().map(|d| d.tokens.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows * width);
        for (row, draft) in self.rows.iter().zip(drafts) {
            ids.push(row.next);
            ids.extend_from_slice(&draft.tokens);
            // Padding: read, never kept.
            ids.resize(ids.len() + width - 1 - draft.tokens.len(), row.next);
        }
        let started = Instant::now();
        let ids = Tensor::from_vec(ids, (rows, width), self.model.device())?;
        cache.check_append(width)?;
        cache.round_begin()?;
        let logits = match self.model.forward(&ids, cache, LogitsMode::All) {
            Ok(l) => l,
            Err(e) => {
                let _ = cache.round_rollback(&vec![0; rows]);
                for row in &mut self.rows {
                    if let Some(d) = row.drafter.as_mut() {
                        let _ = d.accepted(0);
                    }
                }
                return Err(e.into());
            }
        };
        self.times.decode_submit += started.elapsed();
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let vocab = logits.len() / (rows * width);
        let mut keep = vec![1; rows];
        let tokenizer = self.tokenizer;
        for (i, (row, draft)) in self.rows.iter_mut().zip(drafts).enumerate() {
            if done.contains(&i) {
                keep[i] = 0;
                continue;
            }
            let at: Vec<&[f32]> = (0..width)
                .map(|j| &logits[(i * width + j) * vocab..(i * width + j + 1) * vocab])
                .collect();
            let decided = row.verify(draft, &at);
            let accepted = decided.len() - 1;
            keep[i] = 1 + accepted;
            let n = draft.tokens.len();
            if n == 0 {
                self.spec_stats.plain_steps += 1;
            } else {
                self.spec_stats.count_round(n, accepted);
                row.draft_len.update(n, accepted);
            }
            if let Some(d) = row.drafter.as_mut() {
                if let Err(e) = d.accepted(accepted) {
                    row.failure = Some(format!("drafting failed: {e}"));
                    events.push(row.finished(StopReason::EndToken));
                    done.push(i);
                    continue;
                }
            }
            for (j, &t) in decided.iter().enumerate() {
                row.sampler.record(t);
                if let Some(reason) = row.emit(t, at[j], tokenizer, events) {
                    events.push(row.finished(reason));
                    done.push(i);
                    // A stop token among the accepted drafts: the row keeps only positions
                    // of tokens it emitted (its cache must hold its history's prefix, which
                    // the prefix store keeps it by).
                    keep[i] = keep[i].min(1 + j);
                    break;
                }
            }
        }
        cache.round_rollback(&keep)?;
        self.times.decode += started.elapsed();
        self.times.decode_steps += 1;
        self.times.decode_rows += rows;
        Ok(())
    }
}
