//! The decode and prefill ledgers of [`CudaModel`] (`lily profile`): one step (or one prompt) run op by
//! op with a timing event before each op (see `crate::profile`), next to the same work timed as it
//! really runs (the decode step as its replayed graph; the prompt unprofiled). The sum of the op times
//! against the real time is what the launches, the gaps between kernels and the host cost.

use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use lily_model::DevicePick;

use super::{CudaModel, CudaState};
use crate::ops::{sample, util};
use crate::profile::Segment;
use crate::Result;

/// One decode step at a context length, op by op.
#[derive(Clone, Debug)]
pub struct DecodeLedger {
    /// Positions held before the profiled steps.
    pub context: usize,
    /// Every op of one step, each the median over the profiled steps (the layers and the final norm
    /// timed inside a replayed graph, the logits and the pick launched one by one).
    pub segments: Vec<Segment>,
    /// GPU time of one step replayed as its CUDA graph (back to back, no token read back).
    pub graph_step_seconds: f64,
    /// Host wall time of one step as generation runs it (graph, the token chosen on the GPU, its id read back).
    pub served_step_seconds: f64,
    /// Device-to-device copy bandwidth (bytes read + written per second).
    pub copy_bandwidth: f64,
    /// The step's graph without each op in turn.
    pub knockouts: KnockOuts,
}

/// The decode step's graph replayed whole and without each op's kernels (`Device::set_knockout`), all
/// at one position: the difference is the op's marginal cost in the graph.
#[derive(Clone, Debug)]
pub struct KnockOuts {
    /// The whole step, captured and replayed as the knock-outs are.
    pub full_step_seconds: f64,
    /// (op, seconds a step without its kernels, kernels skipped), in the step's order.
    pub without: Vec<(&'static str, f64, u64)>,
}

/// One prompt's prefill, op by op.
#[derive(Clone, Debug)]
pub struct PrefillLedger {
    pub tokens: usize,
    pub chunk: usize,
    /// Every op of every chunk, in order.
    pub segments: Vec<Segment>,
    /// Host wall time of the same prefill, unprofiled, on a fresh state (with the next token chosen).
    pub prefill_seconds: f64,
    pub copy_bandwidth: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

impl CudaModel {
    /// Profiles decode steps from `state` (which advances by the steps run): `reps` steps op by op and
    /// 32 replayed graph steps, each feeding `token`; then the knock-outs ([`KnockOuts`]), which leave
    /// the state's contents meaningless (a profiled state is for profiling only).
    pub fn profile_decode(&mut self, state: &mut CudaState, token: u32, pick: &DevicePick, reps: usize) -> Result<DecodeLedger> {
        let reps = reps.max(1);
        let graph_steps = 32;
        let context = state.pos;
        self.grow_kv(state, state.pos + reps + 2 * graph_steps + 9)?;
        let copy_bandwidth = self.dev.copy_bandwidth(1 << 30)?;

        // As generation runs it: the graph (captured on the first step), the pick, the id read back.
        for _ in 0..3 {
            self.pick_impl(state, &[token], pick)?;
        }
        let t0 = Instant::now();
        for _ in 0..graph_steps {
            self.pick_impl(state, &[token], pick)?;
        }
        let served_step_seconds = t0.elapsed().as_secs_f64() / graph_steps as f64;

        // The graph alone, back to back.
        let ctx = self.dev.context().clone();
        let (e0, e1) = (ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?, ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?);
        e0.record(self.dev.stream())?;
        for _ in 0..graph_steps {
            self.run_chunk(state, &[token])?;
        }
        e1.record(self.dev.stream())?;
        let graph_step_seconds = e0.elapsed_ms(&e1)? as f64 * 1e-3 / graph_steps as f64;

        // Op by op: the step captured as a graph with an event before each op, replayed; then the
        // logits and the pick (launched after the graph when serving) one by one behind a spin.
        let stream = self.dev.stream().clone();
        self.dev.upload_into(&[token], &mut self.act.ids)?;
        self.dev.synchronize()?;
        self.dev.start_recording();
        stream.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let recorded = self.layers_pass(state, 1, true);
        let rec = self.dev.stop_recording();
        let graph = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        recorded?;
        let rec = rec?;
        let graph = graph?.ok_or_else(|| crate::CudaError::Driver("capturing the profiled step gave no graph".into()))?;
        let mut runs: Vec<Vec<Segment>> = Vec::new();
        let mut in_graph = 0; // the segments of the graph, before the logits and the pick
        for _ in 0..reps {
            let pos = state.pos as i32;
            self.dev.upload_into(&[pos, pos + 1], &mut self.act.step_pos)?;
            graph.launch()?;
            let mut segs = rec.segments()?;
            in_graph = segs.len();
            state.pos += 1;
            util::spin(&self.dev, 5_000_000)?;
            self.dev.start_recording();
            self.logits_rows(0, 1)?;
            let a = &mut self.act;
            self.dev.mark("pick", 4 * self.cfg.vocab_size as u64, 0)?;
            sample::pick(&self.dev, &a.logits, pick, &mut a.pick_edits, &mut a.pick_scratch, &mut a.pick_out)?;
            segs.extend(self.dev.finish_recording()?);
            runs.push(segs);
        }
        drop(graph);
        let mut segments = runs[0].clone();
        for (i, s) in segments.iter_mut().enumerate() {
            s.seconds = median(runs.iter().map(|r| r[i].seconds).collect());
        }

        // Knock-outs: the step captured again without one op's kernels at a time (and once without
        // none, the baseline of the same method), each replayed `graph_steps` times at the same
        // positions: what the graph saves without the op is its marginal cost in the graph, where
        // kernels overlap under PDL and the isolated times above do not add up.
        let mut labels: Vec<&'static str> = Vec::new();
        for s in &segments[..in_graph] {
            if !labels.contains(&s.label) {
                labels.push(s.label);
            }
        }
        let pos0 = state.pos;
        let mut timed = Vec::with_capacity(labels.len() + 1);
        for label in std::iter::once(None).chain(labels.iter().map(|&l| Some(l))) {
            self.dev.set_knockout(label);
            let skipped0 = self.dev.knocked_launches();
            let graph = self.capture_step(state);
            self.dev.set_knockout(None);
            let skipped = self.dev.knocked_launches() - skipped0;
            let graph = graph?;
            let pos = pos0 as i32;
            self.dev.upload_into(&[pos, pos + 1], &mut self.act.step_pos)?;
            for _ in 0..3 {
                graph.launch()?;
            }
            e0.record(self.dev.stream())?;
            for _ in 0..graph_steps {
                graph.launch()?;
            }
            e1.record(self.dev.stream())?;
            timed.push((e0.elapsed_ms(&e1)? as f64 * 1e-3 / graph_steps as f64, skipped));
        }
        state.pos = pos0 + 1;
        let without = labels.into_iter().zip(&timed[1..]).map(|(label, &(t, k))| (label, t, k)).collect();
        let knockouts = KnockOuts { full_step_seconds: timed[0].0, without };
        Ok(DecodeLedger { context, segments, graph_step_seconds, served_step_seconds, copy_bandwidth, knockouts })
    }

    /// Profiles the prefill of `tokens` on fresh states: once unprofiled (timed on the host, the next
    /// token chosen as serving does), once op by op.
    pub fn profile_prefill(&mut self, tokens: &[u32], pick: &DevicePick) -> Result<PrefillLedger> {
        let copy_bandwidth = self.dev.copy_bandwidth(1 << 30)?;
        let mut s = self.new_state_with(tokens.len() + 1)?;
        self.dev.synchronize()?;
        let t0 = Instant::now();
        self.pick_impl(&mut s, tokens, pick)?;
        let prefill_seconds = t0.elapsed().as_secs_f64();
        drop(s);

        let mut s = self.new_state_with(tokens.len() + 1)?;
        let mut segments = Vec::new();
        let n = tokens.len();
        for (ci, chunk) in tokens.chunks(self.max_chunk).enumerate() {
            let t = chunk.len();
            self.dev.upload_into(chunk, &mut self.act.ids)?;
            self.dev.synchronize()?;
            util::spin(&self.dev, 20_000_000)?;
            self.dev.start_recording();
            self.layers_pass(&mut s, t, false)?;
            if (ci + 1) * self.max_chunk >= n {
                self.logits_rows(t - 1, t)?;
                let a = &mut self.act;
                self.dev.mark("pick", 4 * self.cfg.vocab_size as u64, 0)?;
                sample::pick(&self.dev, &a.logits, pick, &mut a.pick_edits, &mut a.pick_scratch, &mut a.pick_out)?;
            }
            segments.extend(self.dev.finish_recording()?);
            s.pos += t;
        }
        Ok(PrefillLedger { tokens: n, chunk: self.max_chunk, segments, prefill_seconds, copy_bandwidth })
    }
}
