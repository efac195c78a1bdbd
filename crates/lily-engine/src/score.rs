//! Teacher-forced scoring: every position predicts the next token of a fixed sequence, so an early
//! difference cannot steer later inputs. The prompt runs in chunks, as serving prefills it.

use lily_model::{Backend, BackendError, Logits};
use serde::Serialize;

/// `lily score`'s output: entry i is the prediction of token i+1 from tokens 0..=i.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ScoreResult {
    pub positions: usize,
    pub perplexity: f64,
    pub token_logprobs: Vec<f64>,
    pub argmax: Vec<u32>,
}

/// Scores `tokens` (at least 2) with prefill chunks of `chunk` tokens.
pub fn score<B: Backend>(backend: &mut B, tokens: &[u32], chunk: usize) -> Result<ScoreResult, BackendError> {
    let vocab = backend.config().vocab_size;
    // Every id is checked, the last one too: it is a target even though it is never an input.
    if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(BackendError::InvalidToken { id, vocab });
    }
    let mut state = backend.new_state();
    let n = tokens.len().saturating_sub(1);
    let (mut token_logprobs, mut argmax) = (Vec::with_capacity(n), Vec::with_capacity(n));
    // The last token is never an input whose prediction is scored.
    for (c, piece) in tokens[..n].chunks(chunk.max(1)).enumerate() {
        let logits = backend.forward(&mut state, piece, Logits::All)?;
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            let next = tokens[c * chunk.max(1) + j + 1] as usize;
            let (lp, am) = log_softmax_at(row, next);
            token_logprobs.push(lp);
            argmax.push(am as u32);
        }
    }
    let mean = if n == 0 { 0.0 } else { token_logprobs.iter().sum::<f64>() / n as f64 };
    Ok(ScoreResult { positions: n, perplexity: (-mean).exp(), token_logprobs, argmax })
}

/// log softmax(row)[i] (in f64) and the row's argmax (first of equals).
pub fn log_softmax_at(row: &[f32], i: usize) -> (f64, usize) {
    let (mut am, mut m) = (0usize, f32::NEG_INFINITY);
    for (j, &v) in row.iter().enumerate() {
        if v > m {
            m = v;
            am = j;
        }
    }
    let sum: f64 = row.iter().map(|&v| ((v - m) as f64).exp()).sum();
    ((row[i] - m) as f64 - sum.ln(), am)
}
