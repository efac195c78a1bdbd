//! Prometheus text for `GET /metrics`: requests by status, tokens, the last request's prefill and
//! decode speeds, the queue depth and the prefix cache's hits.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use crate::worker::EngineHandle;

#[derive(Default)]
pub struct Metrics {
    by_status: Mutex<BTreeMap<u16, u64>>,
}

impl Metrics {
    pub fn count_status(&self, status: u16) {
        *self.by_status.lock().unwrap_or_else(|p| p.into_inner()).entry(status).or_default() += 1;
    }

    pub fn render(&self, engine: &EngineHandle) -> String {
        let st = &engine.stats;
        let mut s = String::new();
        let counter = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |s: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(s, "# HELP lily_requests_total Completion requests by HTTP status.\n# TYPE lily_requests_total counter");
        for (status, n) in self.by_status.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(s, "lily_requests_total{{status=\"{status}\"}} {n}");
        }
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        counter(&mut s, "lily_generations_total", "Requests the engine ran.", l(&st.jobs));
        counter(&mut s, "lily_prompt_tokens_total", "Prompt tokens of the requests run.", l(&st.prompt_tokens));
        counter(&mut s, "lily_prefilled_tokens_total", "Prompt tokens actually prefilled (not from the cache).", l(&st.prefilled_tokens));
        counter(&mut s, "lily_cached_tokens_total", "Prompt tokens taken from the prefix cache.", l(&st.cached_tokens));
        counter(&mut s, "lily_completion_tokens_total", "Tokens generated.", l(&st.completion_tokens));
        counter(&mut s, "lily_cache_hits_total", "Requests that resumed from a cached prefix.", l(&st.cache_hits));
        counter(&mut s, "lily_cache_misses_total", "Requests that found no cached prefix.", l(&st.cache_misses));
        gauge(&mut s, "lily_cache_bytes", "Memory held by the prefix cache's snapshots.", l(&st.cache_bytes) as f64);
        gauge(&mut s, "lily_engine_busy", "1 while the engine is generating, else 0.", l(&st.busy) as f64);
        gauge(&mut s, "lily_queue_depth", "Requests waiting for the engine.", engine.queue_depth.load(Ordering::Relaxed) as f64);
        gauge(&mut s, "lily_prefill_tokens_per_second", "Prefill speed of the last request.", f64::from_bits(l(&st.last_prefill_tok_s)));
        gauge(&mut s, "lily_decode_tokens_per_second", "Decode speed of the last request.", f64::from_bits(l(&st.last_decode_tok_s)));
        s
    }
}
