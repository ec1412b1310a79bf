//! Decode steps run one ahead of their tokens ([`crate::Batch::with_steps_ahead`]). On a GPU
//! a batch step used to queue its forward, then wait for the chosen ids to reach the host,
//! emit them, and only then upload them and queue the next forward: the device idled for
//! that round trip and the host's work around it, every step. Run ahead, a greedy step's
//! ids are chosen on the device and stay there as the next step's input; the host queues
//! that next step first and takes the previous step's tokens while it runs. A row that
//! finishes on those tokens has had one step more computed for it, which leaves with it.
//! Off by default until the device path is measured (NOTES.md, 2026-12-05 night).

use super::request::RequestId;
use crate::EngineError;
use tessera_models::step_graph::HostIds;
use tessera_models::ChosenIds;

/// A decode step whose tokens are chosen but not yet taken by its rows.
pub(crate) struct Ahead {
    /// The request of each row now running, in row order (rows that left since the step
    /// ran are gone from here too: [`Ahead::retain`]).
    pub(crate) rows: Vec<RequestId>,
    /// The tokens on the device (the next step's input), where the device chose them.
    pub(crate) chosen: Option<ChosenIds>,
    tokens: Tokens,
    /// Where each row's token is among the step's (its row then).
    pick: Vec<usize>,
}

enum Tokens {
    OnTheWay(Box<dyn HostIds>),
    Here(Vec<u32>),
}

impl Ahead {
    /// A step over `rows` whose tokens the device chose (`chosen`, copied to the host by
    /// `host`), or the host did (`tokens`).
    pub(crate) fn new(
        rows: Vec<RequestId>,
        chosen: Option<(ChosenIds, Box<dyn HostIds>)>,
        tokens: impl FnOnce() -> Result<Vec<u32>, EngineError>,
    ) -> Result<Self, EngineError> {
        let pick = (0..rows.len()).collect();
        let (chosen, tokens) = match chosen {
            Some((ids, host)) => (Some(ids), Tokens::OnTheWay(host)),
            None => (None, Tokens::Here(tokens()?)),
        };
        Ok(Ahead {
            rows,
            chosen,
            tokens,
            pick,
        })
    }

    /// The tokens where the host already holds them, in row order.
    pub(crate) fn here(&self) -> Option<Vec<u32>> {
        match &self.tokens {
            Tokens::Here(t) => Some(self.pick.iter().map(|&i| t[i]).collect()),
            Tokens::OnTheWay(_) => None,
        }
    }

    /// Keeps rows `keep` (indices of the rows now running, in their new order).
    pub(crate) fn retain(&mut self, keep: &[usize]) -> Result<(), EngineError> {
        let identity = keep.iter().enumerate().all(|(i, &r)| i == r);
        if identity && keep.len() == self.rows.len() {
            return Ok(());
        }
        self.rows = keep.iter().map(|&r| self.rows[r]).collect();
        self.pick = keep.iter().map(|&r| self.pick[r]).collect();
        if let Some(ids) = self.chosen.as_ref() {
            self.chosen = Some(ids.select(keep)?);
        }
        Ok(())
    }

    /// Waits for the tokens: one a running row, in row order.
    pub(crate) fn wait(self) -> Result<Vec<u32>, EngineError> {
        let all = match self.tokens {
            Tokens::OnTheWay(host) => host.wait()?,
            Tokens::Here(t) => t,
        };
        self.pick
            .iter()
            .map(|&i| {
                all.get(i).copied().ok_or_else(|| {
                    EngineError::Invalid(format!("a step ahead gave {} tokens", all.len()))
                })
            })
            .collect()
    }
}
