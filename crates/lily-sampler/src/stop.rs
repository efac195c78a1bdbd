//! [`StopChecker`]: stop token ids, stop strings (matched on the detokenised text, across token
//! boundaries) and the token limit.

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token id or stop string (OpenAI `finish_reason: "stop"`).
    Stop(StopReason),
    /// `max_tokens` reached (OpenAI `finish_reason: "length"`).
    Length,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Finish::Stop(_) => "stop",
            Finish::Length => "length",
        }
    }
}

/// What stopped it (vLLM's `stop_reason`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    Token(u32),
    String(String),
}

/// The result of one [`StopChecker::push`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopStep {
    /// Text that may be sent now.
    pub text: String,
    /// Set when generation must end after this token.
    pub finish: Option<Finish>,
}

/// Tracks one generation's stop conditions.
///
/// Rules (checked in this order for each token, as vLLM does):
/// 1. a stop token id ends generation; its own text is not emitted, held-back text is;
/// 2. a stop string anywhere in the new text (including across token boundaries) ends it; the text
///    before the earliest match is emitted, the stop string and anything after it are not (at equal
///    positions the stop listed first is reported);
/// 3. the `max_tokens`-th token ends it with [`Finish::Length`], emitting all its text.
///
/// Otherwise the longest tail of the text that could still begin a stop string is held back and
/// the rest is emitted; held text is released as soon as it can no longer match, so no text is
/// lost that is not part of a stop string. Empty stop strings are ignored.
#[derive(Clone, Debug)]
pub struct StopChecker {
    stops: Vec<String>,
    stop_ids: Vec<u32>,
    max_tokens: Option<usize>,
    held: String,
    tokens: usize,
    finished: Option<Finish>,
}

impl StopChecker {
    /// `max_tokens: Some(0)` ends at the first token (callers should not sample at all then).
    pub fn new(stop_strings: Vec<String>, stop_ids: Vec<u32>, max_tokens: Option<usize>) -> Self {
        let stops = stop_strings.into_iter().filter(|s| !s.is_empty()).collect();
        StopChecker { stops, stop_ids, max_tokens, held: String::new(), tokens: 0, finished: None }
    }

    /// Tokens pushed so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// How it ended, once it has.
    pub fn finished(&self) -> Option<&Finish> {
        self.finished.as_ref()
    }

    /// Feeds the next token and the text it added. After the end, returns no text and the same
    /// [`Finish`].
    pub fn push(&mut self, id: u32, text: &str) -> StopStep {
        if let Some(f) = &self.finished {
            return StopStep { text: String::new(), finish: Some(f.clone()) };
        }
        self.tokens += 1;
        if self.stop_ids.contains(&id) {
            return self.end(Finish::Stop(StopReason::Token(id)));
        }
        self.held.push_str(text);
        // Only the held tail and the new text can hold a match: anything earlier was emitted
        // because no stop string could start there.
        let mut best: Option<(usize, usize)> = None;
        for (i, s) in self.stops.iter().enumerate() {
            if let Some(pos) = self.held.find(s.as_str()) {
                if best.is_none_or(|(p, _)| pos < p) {
                    best = Some((pos, i));
                }
            }
        }
        if let Some((pos, i)) = best {
            self.held.truncate(pos);
            return self.end(Finish::Stop(StopReason::String(self.stops[i].clone())));
        }
        if self.max_tokens.is_some_and(|m| self.tokens >= m) {
            return self.end(Finish::Length);
        }
        let cut = self.hold_from();
        let rest = self.held.split_off(cut);
        let text = std::mem::replace(&mut self.held, rest);
        StopStep { text, finish: None }
    }

    /// The held-back text, for when generation ends outside the checker (an end-of-sequence
    /// handled elsewhere, a cancellation). Empty after a stop.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn end(&mut self, f: Finish) -> StopStep {
        self.finished = Some(f.clone());
        StopStep { text: std::mem::take(&mut self.held), finish: Some(f) }
    }

    /// Start of the longest tail of `held` that is a proper prefix of some stop string.
    fn hold_from(&self) -> usize {
        let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let len = self.held.len();
        let first = len.saturating_sub(longest.saturating_sub(1));
        (first..len)
            .filter(|&i| self.held.is_char_boundary(i))
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .unwrap_or(len)
    }
}
