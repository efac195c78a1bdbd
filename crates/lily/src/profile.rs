//! `lily profile`: the decode and prefill ledgers on the GPU. For one decode step at a context length,
//! every op with its time, the bytes it must move and its share of the measured copy bandwidth, summed
//! against the step as it really runs (its replayed CUDA graph, and with the token read back); for a
//! prompt, every phase's time and rate against the unprofiled prefill. Tables on stdout (markdown, for
//! docs/PERF.md); `--json` writes every op of every layer.

use std::path::Path;

use anyhow::{bail, Result};
use lily_engine::LoadedModel;
#[cfg(feature = "cuda")]
use {
    lily_cuda::profile::Segment,
    lily_model::Backend,
    lily_sampler::{Defaults, Sampler, SamplingParams},
    std::collections::BTreeMap,
};

/// Random ids (a fixed seed) below `vocab`.
#[cfg(feature = "cuda")]
fn ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = lily_sampler::rng::Rng::from_seed(seed);
    (0..n).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

#[cfg(feature = "cuda")]
struct Row {
    label: &'static str,
    count: usize,
    seconds: f64,
    bytes: u64,
    flops: u64,
}

/// Sums segments by label, in the order labels first appear.
#[cfg(feature = "cuda")]
fn by_label(segs: &[Segment]) -> Vec<Row> {
    let mut order: Vec<&'static str> = Vec::new();
    let mut rows: BTreeMap<&'static str, Row> = BTreeMap::new();
    for s in segs {
        let r = rows.entry(s.label).or_insert_with(|| {
            order.push(s.label);
            Row { label: s.label, count: 0, seconds: 0.0, bytes: 0, flops: 0 }
        });
        r.count += 1;
        r.seconds += s.seconds;
        r.bytes += s.bytes;
        r.flops += s.flops;
    }
    order.into_iter().map(|l| rows.remove(l).unwrap()).collect()
}

#[cfg(feature = "cuda")]
fn seg_json(segs: &[Segment]) -> serde_json::Value {
    serde_json::Value::Array(
        segs.iter()
            .map(|s| serde_json::json!({"label": s.label, "layer": s.layer, "us": s.seconds * 1e6, "bytes": s.bytes, "flops": s.flops}))
            .collect(),
    )
}

pub fn run(m: &mut LoadedModel, model: &Path, contexts: &[usize], prompts: &[usize], reps: usize, json: Option<&Path>) -> Result<()> {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (m, model, contexts, prompts, reps, json);
        bail!("lily profile needs the CUDA backend, and this build has none");
    }
    #[cfg(feature = "cuda")]
    {
        let LoadedModel::Cuda(cm) = m else { bail!("lily profile runs on the CUDA backend (--backend cuda)") };
        let vocab = cm.config().vocab_size;
        let greedy = SamplingParams { temperature: Some(0.0), ..Default::default() };
        let mut sampler = Sampler::new(&greedy, &Defaults::default(), vocab)?;
        let Some(pick) = sampler.device_pick() else { bail!("a greedy pick could not run on the device") };
        let mut doc = serde_json::json!({"model": model.display().to_string(), "device": cm.report().device, "decode": [], "prefill": []});
        for &ctx in contexts {
            let mut s = cm.new_state_with(ctx + reps + 128)?;
            if ctx > 0 {
                cm.forward(&mut s, &ids(ctx, vocab, 1), lily_model::Logits::None)?;
            }
            let l = cm.profile_decode(&mut s, ids(1, vocab, 2)[0], &pick, reps)?;
            let bw = l.copy_bandwidth;
            let sum: f64 = l.segments.iter().map(|s| s.seconds).sum();
            let bytes: u64 = l.segments.iter().map(|s| s.bytes).sum();
            println!(
                "\n### Decode ledger at a {} context ({} ops a step; median of {} profiled steps)\n",
                l.context,
                l.segments.len(),
                reps
            );
            println!("copy bandwidth {:.0} GB/s; bytes a step {:.1} MB → floor {:.1} µs\n", bw / 1e9, bytes as f64 / 1e6, bytes as f64 / bw * 1e6);
            println!("| op | launches | µs | % of step | MB | floor µs | % of bandwidth |");
            println!("|---|---:|---:|---:|---:|---:|---:|");
            for r in by_label(&l.segments) {
                let floor = r.bytes as f64 / bw;
                println!(
                    "| {} | {} | {:.1} | {:.1} | {:.2} | {:.1} | {:.0} |",
                    r.label,
                    r.count,
                    r.seconds * 1e6,
                    100.0 * r.seconds / sum,
                    r.bytes as f64 / 1e6,
                    floor * 1e6,
                    100.0 * floor / r.seconds
                );
            }
            println!(
                "| **sum of ops** | {} | **{:.1}** | 100 | {:.1} | {:.1} | {:.0} |",
                l.segments.len(),
                sum * 1e6,
                bytes as f64 / 1e6,
                bytes as f64 / bw * 1e6,
                100.0 * (bytes as f64 / bw) / sum
            );
            println!(
                "\nreplayed graph: {:.1} µs a step ({:.0} tok/s); as served (graph + pick + id read back): {:.1} µs ({:.0} tok/s); \
                 ops summed minus graph: {:.1} µs",
                l.graph_step_seconds * 1e6,
                1.0 / l.graph_step_seconds,
                l.served_step_seconds * 1e6,
                1.0 / l.served_step_seconds,
                (sum - l.graph_step_seconds) * 1e6
            );
            // Marginal costs: the graph without each op's kernels (wrong results, right timings).
            let k = &l.knockouts;
            println!("\nmarginal cost in the graph (the step captured without each op's kernels, all at one position; whole step {:.1} µs):\n", k.full_step_seconds * 1e6);
            println!("| op | kernels | step without them µs | marginal µs | marginal µs a kernel |");
            println!("|---|---:|---:|---:|---:|");
            let mut marginal_sum = 0.0;
            for &(label, without, kernels) in &k.without {
                let m = k.full_step_seconds - without;
                marginal_sum += m;
                println!("| {label} | {kernels} | {:.1} | {:.1} | {:.2} |", without * 1e6, m * 1e6, m * 1e6 / kernels.max(1) as f64);
            }
            println!("| **sum of marginals** | | | **{:.1}** | |", marginal_sum * 1e6);
            let knock: Vec<serde_json::Value> =
                k.without.iter().map(|(label, w, n)| serde_json::json!({"op": label, "step_without_us": w * 1e6, "kernels": n})).collect();
            doc["decode"].as_array_mut().unwrap().push(serde_json::json!({
                "context": l.context, "copy_bandwidth": bw, "graph_step_us": l.graph_step_seconds * 1e6,
                "served_step_us": l.served_step_seconds * 1e6, "ops": seg_json(&l.segments),
                "knockout_full_step_us": k.full_step_seconds * 1e6, "knockouts": knock,
            }));
        }
        for &n in prompts {
            let l = cm.profile_prefill(&ids(n, vocab, 3), &pick)?;
            let sum: f64 = l.segments.iter().map(|s| s.seconds).sum();
            let flops: u64 = l.segments.iter().map(|s| s.flops).sum();
            println!("\n### Prefill ledger of a {}-token prompt (chunks of {})\n", l.tokens, l.chunk);
            println!("| phase | launches | ms | % | TFLOP | TFLOP/s | GB | GB/s |");
            println!("|---|---:|---:|---:|---:|---:|---:|---:|");
            for r in by_label(&l.segments) {
                println!(
                    "| {} | {} | {:.2} | {:.1} | {:.2} | {:.0} | {:.2} | {:.0} |",
                    r.label,
                    r.count,
                    r.seconds * 1e3,
                    100.0 * r.seconds / sum,
                    r.flops as f64 / 1e12,
                    r.flops as f64 / r.seconds / 1e12,
                    r.bytes as f64 / 1e9,
                    r.bytes as f64 / r.seconds / 1e9
                );
            }
            println!(
                "| **sum of ops** | {} | **{:.2}** | 100 | {:.2} | {:.0} | | |",
                l.segments.len(),
                sum * 1e3,
                flops as f64 / 1e12,
                flops as f64 / sum / 1e12
            );
            println!(
                "\nunprofiled prefill: {:.2} ms ({:.0} tok/s); profiled ops sum to {:.0} tok/s",
                l.prefill_seconds * 1e3,
                l.tokens as f64 / l.prefill_seconds,
                l.tokens as f64 / sum
            );
            doc["prefill"].as_array_mut().unwrap().push(serde_json::json!({
                "tokens": l.tokens, "chunk": l.chunk, "prefill_ms": l.prefill_seconds * 1e3, "ops": seg_json(&l.segments),
            }));
        }
        if let Some(p) = json {
            std::fs::write(p, serde_json::to_string_pretty(&doc)? + "\n")?;
        }
        Ok(())
    }
}
