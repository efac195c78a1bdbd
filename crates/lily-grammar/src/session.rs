//! One generation under a compiled grammar: when the grammar starts (at once, after the model's
//! `</think>`, or at its `<tool_call>`), the mask of the tokens allowed next, the tokens that are
//! certain (the `\n\n` after `</think>`, what the grammar forces, the end of the turn once the
//! grammar is complete), and the commit of every token the generation loop chose or fed.

use std::collections::VecDeque;

use llguidance::Matcher;

use crate::GrammarError;

/// A compiled request: clone it into a [`Session`] per generation ([`Constraint::start`]).
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    eos: u32,
    /// Every stop token (the grammar's end-of-sequence set).
    stops: Vec<u32>,
    /// Free text until this token (`</think>`), then `after_think` and the grammar.
    think_end: Option<u32>,
    after_think: Vec<u32>,
    /// Free text until this token (`<tool_call>`), which is the grammar's first.
    tool_call: Option<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("eos", &self.eos)
            .field("think_end", &self.think_end)
            .field("tool_call", &self.tool_call)
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Before the grammar: any token.
    Free,
    /// Under the grammar.
    Active,
    /// The grammar is complete: only the end of the turn follows.
    Done,
    /// The end of the turn came.
    Ended,
}

/// One generation's progress through a [`Constraint`].
pub struct Session {
    c: Constraint,
    phase: Phase,
    /// Tokens the gate feeds before the grammar (the `\n\n` after `</think>`), not yet committed.
    queued: VecDeque<u32>,
}

impl Constraint {
    pub(crate) fn new(matcher: Matcher, stops: Vec<u32>, think_end: Option<u32>, after_think: Vec<u32>, tool_call: Option<u32>) -> Self {
        Constraint { matcher, eos: stops[0], stops, think_end, after_think, tool_call }
    }

    /// A fresh session.
    pub fn start(&self) -> Session {
        let phase = if self.think_end.is_some() || self.tool_call.is_some() { Phase::Free } else { Phase::Active };
        Session { c: self.clone(), phase, queued: VecDeque::new() }
    }
}

fn generation(e: impl std::fmt::Display) -> GrammarError {
    GrammarError::Generation(e.to_string())
}

impl Session {
    /// Whether the next token is constrained (a mask applies): from the grammar's start on.
    pub fn masks_next(&self) -> bool {
        matches!(self.phase, Phase::Active | Phase::Done)
    }

    /// Whether the grammar has started.
    pub fn started(&self) -> bool {
        self.phase != Phase::Free
    }

    /// Whether the grammar is complete (only the end of the turn may follow, or it came).
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done | Phase::Ended)
    }

    /// Writes the tokens allowed next into `mask` (bit `id % 32` of word `id / 32`; words past the
    /// vocabulary's are cleared): the grammar's, or the one certain token (the template's `\n\n`
    /// after `</think>`, the end of the turn). At least one token is allowed, or this is an error.
    pub fn fill_mask(&mut self, mask: &mut [u32]) -> Result<(), GrammarError> {
        let single = match self.phase {
            Phase::Active => self.queued.front().copied(),
            Phase::Done => Some(self.c.eos),
            Phase::Free | Phase::Ended => {
                mask.fill(u32::MAX);
                return Ok(());
            }
        };
        if let Some(t) = single {
            mask.fill(0);
            match mask.get_mut(t as usize / 32) {
                Some(w) => *w = 1 << (t % 32),
                None => return Err(GrammarError::Generation(format!("token {t} is outside the mask"))),
            }
            return Ok(());
        }
        let v = self.c.matcher.compute_mask().map_err(generation)?;
        let words = v.as_slice();
        let n = words.len().min(mask.len());
        mask[..n].copy_from_slice(&words[..n]);
        mask[n..].fill(0);
        if mask.iter().all(|&w| w == 0) {
            return Err(GrammarError::Generation("no token can continue the grammar".into()));
        }
        Ok(())
    }

    /// The tokens certain to come next, in order, that may be fed without sampling (each then
    /// committed): the `\n\n` after `</think>`, what the grammar forces, or the end of the turn
    /// once the grammar is complete. Empty when the model must choose.
    pub fn forced(&mut self) -> Vec<u32> {
        match self.phase {
            Phase::Free | Phase::Ended => Vec::new(),
            Phase::Done => vec![self.c.eos],
            Phase::Active if !self.queued.is_empty() => self.queued.iter().copied().collect(),
            Phase::Active => self.c.matcher.compute_ff_tokens(),
        }
    }

    /// Records the next token of the output (sampled or forced).
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        match self.phase {
            Phase::Free => {
                if Some(token) == self.c.think_end {
                    self.phase = Phase::Active;
                    self.queued.extend(self.c.after_think.iter().copied());
                } else if Some(token) == self.c.tool_call {
                    self.phase = Phase::Active;
                    self.consume(token)?;
                }
                Ok(())
            }
            Phase::Active => {
                if let Some(&q) = self.queued.front() {
                    if q != token {
                        return Err(GrammarError::Generation(format!("token {token} came where the template's {q} was due")));
                    }
                    self.queued.pop_front();
                    return Ok(());
                }
                self.consume(token)
            }
            // The end of the turn (or any stop token) after a complete grammar.
            Phase::Done | Phase::Ended => {
                self.phase = Phase::Ended;
                Ok(())
            }
        }
    }

    fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        self.c.matcher.consume_token(token).map_err(generation)?;
        if self.c.matcher.is_stopped() {
            // Stopped on a stop token the grammar allowed: the turn has ended; else only one may follow.
            self.phase = if self.c.stops.contains(&token) { Phase::Ended } else { Phase::Done };
        }
        Ok(())
    }
}
