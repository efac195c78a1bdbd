//! `lily info`: what a checkpoint holds, in words: the architecture, the parameters in all and those
//! a token uses, how the weights are stored and how much room they take (on disk, and in memory
//! once loaded), the context, the tokenizer and the chat template.

use std::path::Path;

use anyhow::Result;
use lily_model::LayerKind;
use lily_model::weights::{Matrix, Mixer, Mlp, SourceFormat, Storage};
use lily_model::{ModelConfig, ModelWeights};

/// "19.4 GB", "812.0 MB", "4.2 KB".
pub fn bytes(n: u64) -> String {
    let n = n as f64;
    match n {
        _ if n >= 1e9 => format!("{:.1} GB", n / 1e9),
        _ if n >= 1e6 => format!("{:.1} MB", n / 1e6),
        _ if n >= 1e3 => format!("{:.1} KB", n / 1e3),
        _ => format!("{n} bytes"),
    }
}

/// "34.7 billion", "3.3 million", "5,120".
pub fn count(n: u64) -> String {
    let f = n as f64;
    match f {
        _ if f >= 1e9 => format!("{:.1} billion", f / 1e9),
        _ if f >= 1e6 => format!("{:.1} million", f / 1e6),
        _ => {
            let s = n.to_string();
            let mut out = String::new();
            for (i, c) in s.chars().enumerate() {
                if i > 0 && (s.len() - i).is_multiple_of(3) {
                    out.push(',');
                }
                out.push(c);
            }
            out
        }
    }
}

fn float_bytes(b: &lily_model::buf::FloatBuf) -> u64 {
    let per = if b.dtype_name() == "F32" { 4 } else { 2 };
    (b.len() * per) as u64
}

/// (parameters, bytes in memory) of a matrix or stack.
fn matrix(m: &Matrix) -> (u64, u64) {
    let params = (m.count * m.rows * m.cols) as u64;
    let mem = match &m.storage {
        Storage::Affine { packed, scales, biases, .. } => (packed.len() * 4) as u64 + float_bytes(scales) + float_bytes(biases),
        Storage::Dense(b) => float_bytes(b),
    };
    (params, mem)
}

/// Parameters in all, parameters a token uses (all but the experts it is not routed to), bytes in
/// memory.
fn tally(w: &ModelWeights) -> (u64, u64, u64) {
    let (mut all, mut unused, mut mem) = (0u64, 0u64, 0u64);
    let mut add = |m: &Matrix| {
        let (p, b) = matrix(m);
        all += p;
        mem += b;
        p
    };
    let vec = |v: &[f32]| v.len() as u64;
    let mut small = vec(&w.final_norm);
    add(&w.embed);
    if !w.config.tie_word_embeddings {
        add(w.lm_head());
    }
    let cfg = &w.config;
    for l in &w.layers {
        small += vec(&l.input_norm) + vec(&l.post_norm);
        match &l.mixer {
            Mixer::Linear(g) => {
                for m in [&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a, &g.out_proj] {
                    add(m);
                }
                small += vec(&g.conv1d) + vec(&g.dt_bias) + vec(&g.a_log) + vec(&g.norm);
            }
            Mixer::Full(a) => {
                for m in [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj] {
                    add(m);
                }
                small += vec(&a.q_norm) + vec(&a.k_norm);
            }
        }
        match &l.mlp {
            Mlp::Moe(moe) => {
                add(&moe.router);
                let experts = add(&moe.gate_proj) + add(&moe.up_proj) + add(&moe.down_proj);
                if moe.gate_proj.count > 0 {
                    let idle = moe.gate_proj.count.saturating_sub(cfg.num_experts_per_tok) as u64;
                    unused += experts / moe.gate_proj.count as u64 * idle;
                }
                if let Some(s) = &moe.shared {
                    for m in [&s.gate_proj, &s.up_proj, &s.down_proj] {
                        add(m);
                    }
                }
                if let Some(g) = &moe.shared_gate {
                    add(g);
                }
            }
            Mlp::Dense(d) => {
                for m in [&d.gate_proj, &d.up_proj, &d.down_proj] {
                    add(m);
                }
            }
        }
    }
    // The norms and gates are kept in f32.
    (all + small, all + small - unused, mem + small * 4)
}

fn storage(cfg: &ModelConfig, source: SourceFormat) -> String {
    match (source, &cfg.quantization) {
        (SourceFormat::MlxAffine, Some(q)) => {
            let mut s = format!("MLX affine {}-bit, groups of {}", q.bits, q.group_size);
            if !q.overrides.is_empty() {
                s.push_str(&format!(" ({} matrices with their own bits, such as the 8-bit router gates)", q.overrides.len()));
            }
            s
        }
        (SourceFormat::MlxAffine, None) => "MLX affine".into(),
        (SourceFormat::HfQuantizedAtLoad, _) => "Hugging Face bf16, quantised at load to 4-bit groups of 64 as mlx_lm.convert does (--keep-bf16 keeps bf16)".into(),
        (SourceFormat::HfDense, _) => "Hugging Face bf16, kept in bf16 (--keep-bf16)".into(),
    }
}

pub fn print(dir: &Path, w: &ModelWeights) -> Result<()> {
    let cfg = &w.config;
    let (all, used, mem) = tally(w);
    let files: Vec<u64> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok().map(|m| m.len()))
        .collect();
    let gdn = cfg.layer_types.iter().filter(|k| **k == LayerKind::LinearAttention).count();
    println!("{}", dir.display());
    println!("  model         {} ({}): {} layers, {gdn} Gated DeltaNet and {} full attention", family(&cfg.model_type), cfg.model_type, cfg.num_hidden_layers, cfg.num_full_attention_layers());
    println!(
        "  parameters    {} in all; {} used per token (the experts a token is not routed to left out)",
        count(all),
        count(used)
    );
    println!("  weights       {}", storage(cfg, w.source));
    println!(
        "  size          {} on disk in {} safetensors file{}; {} in memory once loaded",
        bytes(files.iter().sum()),
        files.len(),
        if files.len() == 1 { "" } else { "s" },
        bytes(mem)
    );
    println!("  context       up to {} tokens", count(cfg.max_position_embeddings as u64));
    println!("  hidden size   {}", cfg.hidden_size);
    println!(
        "  attention     {} query heads sharing {} key/value heads, {} wide ({} rotary dimensions)",
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    );
    println!(
        "  deltanet      {} key heads {} wide, {} value heads {} wide",
        cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    );
    if cfg.num_experts > 0 {
        println!(
            "  experts       {} per layer, {} chosen per token, {} wide; a shared expert {} wide",
            cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        );
    }
    let tok = match lily_tokenizer::Tokenizer::from_dir(dir) {
        Ok(t) => format!("; its tokenizer has {} entries", count(t.vocab_size() as u64)),
        Err(_) => "; no usable tokenizer.json (lily score and bench still work, chat and serve do not)".into(),
    };
    println!("  vocabulary    {} tokens{tok}", count(cfg.vocab_size as u64));
    let template = match lily_template::ChatTemplate::from_dir(dir).map(|t| t.source()) {
        Ok(lily_template::TemplateSource::Checkpoint(p)) => format!("the checkpoint's own ({})", p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()),
        Ok(_) => "none in the checkpoint: lily's built-in Qwen3.6 template".into(),
        Err(e) => format!("unusable: {e}"),
    };
    println!("  chat template {template}");
    Ok(())
}

fn family(model_type: &str) -> &'static str {
    match model_type {
        "qwen3_5_moe" | "qwen3_5_moe_text" => "Qwen3.5/3.6 MoE",
        _ => "a Qwen3.5/3.6 relative",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_counts_in_words() {
        assert_eq!(bytes(19_400_000_000), "19.4 GB");
        assert_eq!(bytes(812_000), "812.0 KB");
        assert_eq!(bytes(12), "12 bytes");
        assert_eq!(count(34_660_000_000), "34.7 billion");
        assert_eq!(count(5_120), "5,120");
        assert_eq!(count(248_320), "248,320");
        assert_eq!(count(1_234_567), "1.2 million");
    }
}
