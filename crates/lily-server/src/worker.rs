//! The engine thread: it owns the backend (one model, one sequence at a time), takes jobs from a
//! bounded FIFO queue, resumes each prompt from the longest cached prefix, generates, and streams
//! events back over a channel. A job whose receiver is gone (the client hung up) or whose cancel
//! flag is set stops at the next token; once the server stops ([`EngineHandle::stop`]) the running
//! job stops at its next token too, and queued jobs fail.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use lily_engine::{generate_cached_at, FinishReason, Flow, GenSpec, PrefixCache};
use lily_model::Backend;
use lily_tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

/// One generation request for the engine thread.
pub struct Job {
    pub prompt: Vec<u32>,
    /// The first `history` prompt tokens are conversation history that a later request will
    /// share: the state is snapshotted there (0: no such snapshot).
    pub history: usize,
    /// The first `system` prompt tokens are the system prompt and tools, which requests with other
    /// conversations share (an agent's sub-agents, a retried first turn): snapshotted too (0: none).
    pub system: usize,
    pub spec: GenSpec,
    pub events: UnboundedSender<Event>,
    pub cancel: Arc<AtomicBool>,
    /// Give up if the job is still queued at this instant.
    pub deadline: Instant,
}

/// What the engine thread reports about a job, in order: Started, Token*, Tail?, Done (or Failed).
#[derive(Debug)]
pub enum Event {
    Started { prompt_tokens: usize, cached_tokens: usize },
    Token { id: u32, text: String, logprob: Option<f32>, top_logprobs: Vec<(u32, f32)> },
    /// Text held back until the end (a partial character, a prefix of a stop string that never came).
    Tail(String),
    Done { finish: FinishReason, completion_tokens: usize, speed: Option<Speed> },
    Failed(JobError),
}

/// How fast a job ran (for the request log).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speed {
    /// Prompt tokens run through the model (not taken from the cache), and at what rate.
    pub prefilled: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum JobError {
    #[error("the request waited too long in the queue")]
    TimedOut,
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("generation failed: {0}")]
    Engine(String),
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the queue is full")]
    QueueFull,
    #[error("the engine has stopped")]
    Stopped,
}

/// Counters the engine thread keeps for /metrics.
#[derive(Default)]
pub struct Stats {
    pub prompt_tokens: AtomicU64,
    pub prefilled_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub jobs: AtomicU64,
    /// f64 bits of the last job's speeds.
    pub last_prefill_tok_s: AtomicU64,
    pub last_decode_tok_s: AtomicU64,
    pub cache_bytes: AtomicU64,
    /// 1 while the engine runs a job.
    pub busy: AtomicU64,
    /// Microseconds the engine spent on jobs (for Retry-After: the mean job time).
    pub busy_micros: AtomicU64,
}

impl Stats {
    /// The mean time of a job so far (None before the first).
    pub fn mean_job_time(&self) -> Option<std::time::Duration> {
        let jobs = self.jobs.load(Ordering::Relaxed);
        (jobs > 0).then(|| std::time::Duration::from_micros(self.busy_micros.load(Ordering::Relaxed) / jobs))
    }
}

/// The async side's handle on the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Job>,
    pub queue_depth: Arc<AtomicUsize>,
    pub stats: Arc<Stats>,
    stopping: Arc<AtomicBool>,
}

impl EngineHandle {
    /// Stops the engine taking work: the running job ends at its next token (finish `Cancelled`),
    /// queued jobs fail with [`JobError::ShuttingDown`], new ones are refused.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Queues a job, or refuses at once when `max_queue` jobs are already waiting.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if self.is_stopping() {
            return Err(SubmitError::Stopped);
        }
        self.queue_depth.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.queue_depth.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::QueueFull,
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }
}

/// Starts the engine thread over `backend`.
pub fn spawn<B>(mut backend: B, tokenizer: Arc<Tokenizer>, max_queue: usize, cache_bytes: usize) -> EngineHandle
where
    B: Backend + 'static,
    B::State: 'static,
{
    let (tx, rx) = sync_channel::<Job>(max_queue.max(1));
    let queue_depth = Arc::new(AtomicUsize::new(0));
    let stats = Arc::new(Stats::default());
    let stopping = Arc::new(AtomicBool::new(false));
    let (depth, st, stop) = (Arc::clone(&queue_depth), Arc::clone(&stats), Arc::clone(&stopping));
    std::thread::Builder::new()
        .name("lily-engine".into())
        .spawn(move || {
            let mut cache: PrefixCache<B::State> = PrefixCache::new(cache_bytes);
            while let Ok(job) = rx.recv() {
                depth.fetch_sub(1, Ordering::SeqCst);
                if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
                    continue;
                }
                if stop.load(Ordering::SeqCst) {
                    let _ = job.events.send(Event::Failed(JobError::ShuttingDown));
                    continue;
                }
                if Instant::now() > job.deadline {
                    let _ = job.events.send(Event::Failed(JobError::TimedOut));
                    continue;
                }
                st.busy.store(1, Ordering::SeqCst);
                let t = Instant::now();
                // A panic fails this job (its channel closes: the client gets an error), not the
                // engine thread; the cache may hold a half-made snapshot, so it is dropped.
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&mut backend, &tokenizer, &mut cache, &st, &stop, job)));
                if ran.is_err() {
                    cache.clear();
                }
                st.busy_micros.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                st.busy.store(0, Ordering::SeqCst);
                st.cache_hits.store(cache.hits, Ordering::Relaxed);
                st.cache_misses.store(cache.misses, Ordering::Relaxed);
                st.cache_bytes.store(cache.used_bytes() as u64, Ordering::Relaxed);
            }
        })
        .expect("spawning the engine thread");
    EngineHandle { tx, queue_depth, stats, stopping }
}

fn run<B: Backend>(backend: &mut B, tokenizer: &Tokenizer, cache: &mut PrefixCache<B::State>, st: &Stats, stop: &AtomicBool, job: Job) {
    let Job { prompt, history, system, spec, events, cancel, .. } = job;
    st.jobs.fetch_add(1, Ordering::Relaxed);
    let started = |cached: usize| {
        st.prompt_tokens.fetch_add(prompt.len() as u64, Ordering::Relaxed);
        st.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        st.prefilled_tokens.fetch_add((prompt.len() - cached) as u64, Ordering::Relaxed);
        match events.send(Event::Started { prompt_tokens: prompt.len(), cached_tokens: cached }) {
            Ok(()) => Flow::Continue,
            Err(_) => Flow::Cancel,
        }
    };
    let on_step = |step: lily_engine::Step<'_>| {
        let sent = events.send(Event::Token {
            id: step.token,
            text: step.text.to_string(),
            logprob: step.logprob,
            top_logprobs: step.top_logprobs.to_vec(),
        });
        if sent.is_err() || cancel.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed) {
            Flow::Cancel
        } else {
            Flow::Continue
        }
    };
    let points = if system > 0 && system < history { vec![system, history] } else { vec![history] };
    let outcome = match generate_cached_at(backend, cache, &prompt, &points, tokenizer, &spec, started, on_step) {
        Ok(Some(o)) => o.outcome,
        Ok(None) => return,
        Err(e) => {
            let _ = events.send(Event::Failed(JobError::Engine(e.to_string())));
            return;
        }
    };
    st.last_prefill_tok_s.store(outcome.prefill_tok_s().to_bits(), Ordering::Relaxed);
    st.last_decode_tok_s.store(outcome.decode_tok_s().to_bits(), Ordering::Relaxed);
    st.completion_tokens.fetch_add(outcome.tokens.len() as u64, Ordering::Relaxed);
    let speed = Speed { prefilled: outcome.prefilled, prefill_tok_s: outcome.prefill_tok_s(), decode_tok_s: outcome.decode_tok_s() };
    if !outcome.trailing_text.is_empty() {
        let _ = events.send(Event::Tail(outcome.trailing_text));
    }
    let _ = events.send(Event::Done { finish: outcome.finish, completion_tokens: outcome.tokens.len(), speed: Some(speed) });
}
