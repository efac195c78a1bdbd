//! `synth::synthesize` writes what `mlx_lm.convert -q` writes for a qwen3_5_moe model: checked here
//! against an independent listing of the tensors mlx-lm's model has after quantisation (names, shapes,
//! dtypes), plus the files, the index, config.json's quantisation block, determinism, sharding and
//! the value statistics. (`tools/check_synth_mlx.py` loads the output into mlx-lm itself.)

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use lily_model::affine::{dequantize_row_bf16, AffineParams};
use lily_model::synth::{builtin_config, builtin_names, synthesize, SynthOptions};
use lily_model::{Error, LayerKind, ModelConfig};
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

/// A small config exercising what the built-ins do not: a plain text config (no `text_config`),
/// tied embeddings, modules left unquantised (shared expert width 96 and GDN value dim 96 are not
/// multiples of 64), a 2-layer interval.
fn odd_config() -> Value {
    json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "vocab_size": 1000,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 3,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2]},
        "eos_token_id": 248044
    })
}

#[derive(Debug, PartialEq)]
struct Spec {
    dtype: Dtype,
    shape: Vec<usize>,
}

/// What mlx-lm's `qwen3_5_moe.Model` holds after `quantize_model` (global bits/group, routers at
/// 8 bits group 64, modules with `in % group != 0` left in bf16), written from the module structure.
fn expected(cfg: &ModelConfig, bits: usize, gs: usize) -> BTreeMap<String, Spec> {
    let mut m = BTreeMap::new();
    let linear =
        |m: &mut BTreeMap<String, Spec>, path: String, lead: &[usize], out: usize, inp: usize, router: bool| {
            let mut shape: Vec<usize> = lead.to_vec();
            shape.push(out);
            if !inp.is_multiple_of(gs) {
                shape.push(inp);
                m.insert(format!("{path}.weight"), Spec { dtype: Dtype::BF16, shape });
                return;
            }
            let (b, g) = if router { (8, 64) } else { (bits, gs) };
            let mut w = shape.clone();
            w.push(inp * b / 32);
            let mut s = shape;
            s.push(inp / g);
            m.insert(format!("{path}.weight"), Spec { dtype: Dtype::U32, shape: w });
            m.insert(format!("{path}.scales"), Spec { dtype: Dtype::BF16, shape: s.clone() });
            m.insert(format!("{path}.biases"), Spec { dtype: Dtype::BF16, shape: s });
        };
    let vec1 = |m: &mut BTreeMap<String, Spec>, name: String, n: usize, dtype: Dtype| {
        m.insert(name, Spec { dtype, shape: vec![n] });
    };
    let h = cfg.hidden_size;
    linear(&mut m, "language_model.model.embed_tokens".into(), &[], cfg.vocab_size, h, false);
    if !cfg.tie_word_embeddings {
        linear(&mut m, "language_model.lm_head".into(), &[], cfg.vocab_size, h, false);
    }
    vec1(&mut m, "language_model.model.norm.weight".into(), h, Dtype::BF16);
    for l in 0..cfg.num_hidden_layers {
        let p = format!("language_model.model.layers.{l}");
        vec1(&mut m, format!("{p}.input_layernorm.weight"), h, Dtype::BF16);
        vec1(&mut m, format!("{p}.post_attention_layernorm.weight"), h, Dtype::BF16);
        if cfg.layer_types[l] == LayerKind::LinearAttention {
            let a = format!("{p}.linear_attn");
            let (kd, vd, hv) = (cfg.linear_key_dim(), cfg.linear_value_dim(), cfg.linear_num_value_heads);
            let conv = 2 * kd + vd;
            linear(&mut m, format!("{a}.in_proj_qkv"), &[], conv, h, false);
            linear(&mut m, format!("{a}.in_proj_z"), &[], vd, h, false);
            linear(&mut m, format!("{a}.in_proj_b"), &[], hv, h, false);
            linear(&mut m, format!("{a}.in_proj_a"), &[], hv, h, false);
            linear(&mut m, format!("{a}.out_proj"), &[], h, vd, false);
            m.insert(
                format!("{a}.conv1d.weight"),
                Spec { dtype: Dtype::BF16, shape: vec![conv, cfg.linear_conv_kernel_dim, 1] },
            );
            vec1(&mut m, format!("{a}.A_log"), hv, Dtype::F32);
            vec1(&mut m, format!("{a}.dt_bias"), hv, Dtype::BF16);
            vec1(&mut m, format!("{a}.norm.weight"), cfg.linear_value_head_dim, Dtype::BF16);
        } else {
            let a = format!("{p}.self_attn");
            let (nh, kv, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
            linear(&mut m, format!("{a}.q_proj"), &[], nh * d * 2, h, false);
            linear(&mut m, format!("{a}.k_proj"), &[], kv * d, h, false);
            linear(&mut m, format!("{a}.v_proj"), &[], kv * d, h, false);
            linear(&mut m, format!("{a}.o_proj"), &[], h, nh * d, false);
            vec1(&mut m, format!("{a}.q_norm.weight"), d, Dtype::BF16);
            vec1(&mut m, format!("{a}.k_norm.weight"), d, Dtype::BF16);
        }
        let mp = format!("{p}.mlp");
        let (e, i, s) = (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size);
        linear(&mut m, format!("{mp}.gate"), &[], e, h, true);
        linear(&mut m, format!("{mp}.shared_expert_gate"), &[], 1, h, true);
        linear(&mut m, format!("{mp}.shared_expert.gate_proj"), &[], s, h, false);
        linear(&mut m, format!("{mp}.shared_expert.up_proj"), &[], s, h, false);
        linear(&mut m, format!("{mp}.shared_expert.down_proj"), &[], h, s, false);
        linear(&mut m, format!("{mp}.switch_mlp.gate_proj"), &[e], i, h, false);
        linear(&mut m, format!("{mp}.switch_mlp.up_proj"), &[e], i, h, false);
        linear(&mut m, format!("{mp}.switch_mlp.down_proj"), &[e], h, i, false);
    }
    m
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

struct Loaded {
    files: Vec<String>,
    specs: BTreeMap<String, Spec>,
    data: BTreeMap<String, Vec<u8>>,
}

/// Reads every shard named by the index; checks the index and headers on the way.
fn load(dir: &Path) -> Loaded {
    let mut files: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    let index = read_json(&dir.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    let mut shards: Vec<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    shards.sort();
    shards.dedup();
    let mut specs = BTreeMap::new();
    let mut data = BTreeMap::new();
    let mut total = 0u64;
    for s in &shards {
        let bytes = std::fs::read(dir.join(s)).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0, "{s}: header length {n} not padded to 8");
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert_eq!(header["__metadata__"], json!({"format": "mlx"}), "{s}");
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            assert_eq!(map[&name].as_str().unwrap(), *s, "{name} is in {s} but the index says otherwise");
            total += view.data().len() as u64;
            specs.insert(name.clone(), Spec { dtype: view.dtype(), shape: view.shape().to_vec() });
            data.insert(name, view.data().to_vec());
        }
    }
    assert_eq!(specs.len(), map.len(), "index names tensors that no shard holds");
    assert_eq!(index["metadata"]["total_size"].as_u64().unwrap(), total);
    Loaded { files, specs, data }
}

fn bf16s(b: &[u8]) -> Vec<bf16> {
    b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect()
}
fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Mean and std of a quantised module, dequantised.
fn stats(l: &Loaded, path: &str, p: AffineParams) -> (f64, f64) {
    let w = u32s(&l.data[&format!("{path}.weight")]);
    let s = bf16s(&l.data[&format!("{path}.scales")]);
    let b = bf16s(&l.data[&format!("{path}.biases")]);
    let shape = &l.specs[&format!("{path}.weight")].shape;
    let cols = shape[shape.len() - 1] * 32 / p.bits as usize;
    let rows = w.len() / p.words_per_row(cols);
    let (wpr, gpr) = (p.words_per_row(cols), p.groups_per_row(cols));
    let mut out = vec![0f32; cols];
    let (mut s1, mut s2) = (0f64, 0f64);
    for r in 0..rows {
        dequantize_row_bf16(
            &w[r * wpr..(r + 1) * wpr],
            &s[r * gpr..(r + 1) * gpr],
            &b[r * gpr..(r + 1) * gpr],
            p,
            &mut out,
        );
        for &x in &out {
            s1 += x as f64;
            s2 += (x as f64) * (x as f64);
        }
    }
    let n = (rows * cols) as f64;
    let mean = s1 / n;
    (mean, (s2 / n - mean * mean).sqrt())
}

fn run(config: Value, dir: &Path, seed: u64, max_shard_bytes: u64) -> lily_model::synth::SynthReport {
    let mut o = SynthOptions::new(config, dir);
    o.seed = seed;
    o.max_shard_bytes = max_shard_bytes;
    synthesize(&o, &indicatif::ProgressBar::hidden()).unwrap()
}

fn check_layout(config: Value, dir: &Path) -> (ModelConfig, Loaded) {
    let report = run(config, dir, 1, 5 << 30);
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let l = load(dir);
    assert_eq!(
        l.files,
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    assert_eq!(report.files.len(), 6);
    assert_eq!(report.tensors, l.specs.len());
    let want = expected(&cfg, 4, 64);
    let missing: Vec<_> = want.keys().filter(|k| !l.specs.contains_key(*k)).collect();
    let extra: Vec<_> = l.specs.keys().filter(|k| !want.contains_key(*k)).collect();
    assert!(missing.is_empty() && extra.is_empty(), "missing {missing:?}\nextra {extra:?}");
    for (k, s) in &want {
        assert_eq!(&l.specs[k], s, "{k}");
    }

    // config.json: the mlx_lm.convert form.
    let c = read_json(&dir.join("config.json"));
    let keys: Vec<&String> = c.as_object().unwrap().keys().collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted, "top-level keys are sorted, as mlx_lm's save_config writes them");
    assert!(c.get("vision_config").is_none());
    assert_eq!(c["quantization"], c["quantization_config"]);
    // The real tokenizer's <|im_end|> and <|endoftext|>, or the cut-down one's.
    let tok = read_json(&dir.join("tokenizer.json"));
    let id = |content: &str| tok["added_tokens"].as_array().unwrap().iter().find(|a| a["content"] == json!(content)).unwrap()["id"].clone();
    let (im_end, eot) = (id("<|im_end|>"), id("<|endoftext|>"));
    assert_eq!(c["eos_token_id"], json!([im_end, eot]));
    let q = c["quantization"].as_object().unwrap();
    let mut want_q = serde_json::Map::new();
    want_q.insert("group_size".into(), json!(64));
    want_q.insert("bits".into(), json!(4));
    want_q.insert("mode".into(), json!("affine"));
    for l in 0..cfg.num_hidden_layers {
        for m in ["mlp.gate", "mlp.shared_expert_gate"] {
            want_q.insert(format!("language_model.model.layers.{l}.{m}"), json!({"group_size": 64, "bits": 8}));
        }
    }
    assert_eq!(q, &want_q);
    let qc = cfg.quantization.as_ref().unwrap();
    assert_eq!(qc.for_module("language_model.model.layers.0.mlp.gate"), Some((64, 8)));
    assert_eq!(qc.for_module("language_model.model.layers.0.mlp.switch_mlp.up_proj"), Some((64, 4)));

    let g = read_json(&dir.join("generation_config.json"));
    assert_eq!(g["eos_token_id"], json!([im_end, eot]));
    assert_eq!(g["pad_token_id"], eot);
    assert_eq!(g["top_k"], json!(20));
    let t = read_json(&dir.join("tokenizer_config.json"));
    assert_eq!(t["eos_token"], json!("<|im_end|>"));
    assert_eq!(t["pad_token"], json!("<|endoftext|>"));
    assert_eq!(t["add_bos_token"], json!(false));
    // Every id the tokenizer makes is a row of the embedding; the added tokens follow the BPE ones.
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    let added = tok["added_tokens"].as_array().unwrap();
    assert!(vocab.len() + added.len() <= cfg.vocab_size, "{} + {} entries for {} rows", vocab.len(), added.len(), cfg.vocab_size);
    let mut ids: Vec<u64> = vocab.values().map(|v| v.as_u64().unwrap()).collect();
    ids.sort();
    assert!(ids.iter().enumerate().all(|(i, &id)| id == i as u64), "BPE ids are 0..n");
    for (i, a) in added.iter().enumerate() {
        assert_eq!(a["id"], json!(vocab.len() + i));
    }
    for m in tok["model"]["merges"].as_array().unwrap().iter().take(5000) {
        let (a, b) = (m[0].as_str().unwrap(), m[1].as_str().unwrap());
        assert!(vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&format!("{a}{b}")), "merge {m}");
    }
    if cfg.vocab_size >= 248_077 {
        assert_eq!((im_end, eot), (json!(248046), json!(248044)), "the real tokenizer");
        assert_eq!(vocab.len(), 248_044);
    } else {
        // Cut down: the config's own special ids follow it.
        assert!(cfg.eos_token_ids.iter().map(|&i| json!(i)).collect::<Vec<_>>().contains(&eot), "{:?}", cfg.eos_token_ids);
        assert_eq!(vocab.len() + added.len(), cfg.vocab_size);
    }
    (cfg, l)
}

#[test]
fn tiny_builtin_matches_the_mlx_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, l) = check_layout(builtin_config("qwen3.6-tiny").unwrap(), tmp.path());
    assert_eq!(cfg.vocab_size, 248320);
    assert_eq!(cfg.num_hidden_layers, 8);
    assert_eq!(cfg.num_full_attention_layers(), 2);
    assert_eq!((cfg.num_experts, cfg.num_experts_per_tok), (16, 4));

    // Values: each matrix ≈ N(0, target²) with the targets synth documents.
    let p4 = AffineParams { bits: 4, group_size: 64 };
    let p8 = AffineParams { bits: 8, group_size: 64 };
    let h = cfg.hidden_size as f64;
    let branch = 0.8 / (cfg.num_hidden_layers as f64).sqrt();
    let pre = "language_model.model.layers.0";
    for (path, p, want) in [
        (format!("{pre}.linear_attn.in_proj_qkv"), p4, 1.0 / h.sqrt()),
        (format!("{pre}.linear_attn.out_proj"), p4, branch / (cfg.linear_value_dim() as f64).sqrt()),
        (format!("{pre}.mlp.switch_mlp.down_proj"), p4, branch / (cfg.moe_intermediate_size as f64).sqrt()),
        (format!("{pre}.mlp.gate"), p8, 4.0 / h.sqrt()),
        ("language_model.model.embed_tokens".to_string(), p4, 1.0),
        ("language_model.lm_head".to_string(), p4, 3.0 / h.sqrt()),
    ] {
        let (mean, std) = stats(&l, &path, p);
        assert!(mean.abs() < 0.05 * want, "{path}: mean {mean}");
        assert!((std / want - 1.0).abs() < 0.15, "{path}: std {std}, want {want}");
    }
    let norm = bf16s(&l.data["language_model.model.norm.weight"]);
    assert!(norm.iter().all(|x| (x.to_f32() - 1.0).abs() < 0.3));
    // lm_head rows copy half their codes from a (permuted) embedding row.
    let emb = u32s(&l.data["language_model.model.embed_tokens.weight"]);
    let head = u32s(&l.data["language_model.lm_head.weight"]);
    let wpr = cfg.hidden_size / 8;
    let same = |a: &[u32], b: &[u32]| -> usize {
        a.iter().zip(b).map(|(x, y)| (0..8).filter(|k| (x >> (4 * k)) & 15 == (y >> (4 * k)) & 15).count()).sum()
    };
    for j in [0usize, 1, 123_457] {
        let row = &head[j * wpr..(j + 1) * wpr];
        let best = (0..cfg.vocab_size).map(|r| same(row, &emb[r * wpr..(r + 1) * wpr])).max().unwrap();
        let frac = best as f64 / cfg.hidden_size as f64;
        assert!((0.4..0.7).contains(&frac), "lm_head row {j}: best embedding match {frac}");
    }
    let a_log: Vec<f32> = l.data[&format!("{pre}.linear_attn.A_log")]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(a_log.iter().all(|&x| (0.0..=16f32.ln()).contains(&x)));
}

#[test]
fn odd_config_matches_the_mlx_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, l) = check_layout(odd_config(), tmp.path());
    assert!(cfg.tie_word_embeddings);
    assert!(!l.specs.contains_key("language_model.lm_head.weight"));
    // Left in bf16 because 96 % 64 != 0.
    assert_eq!(l.specs["language_model.model.layers.0.mlp.shared_expert.down_proj.weight"].dtype, Dtype::BF16);
    assert_eq!(l.specs["language_model.model.layers.0.linear_attn.out_proj.weight"].dtype, Dtype::BF16);
    assert_eq!(cfg.layer_types[1], LayerKind::FullAttention);
}

#[test]
fn deterministic_and_sharded() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("c"));
    run(odd_config(), &a, 5, 5 << 30);
    // Small shards: several files, same tensors and bytes.
    let r = run(odd_config(), &b, 5, 200_000);
    let shards: Vec<_> = r.files.iter().filter(|f| f.starts_with("model-")).collect();
    assert!(shards.len() > 2, "{:?}", r.files);
    let n = shards.len();
    for (i, f) in shards.iter().enumerate() {
        assert_eq!(**f, format!("model-{:05}-of-{:05}.safetensors", i + 1, n));
    }
    run(odd_config(), &c, 6, 5 << 30);
    let (la, lb, lc) = (load(&a), load(&b), load(&c));
    assert_eq!(la.specs, lb.specs);
    assert_eq!(la.data, lb.data, "same seed, different sharding: different values");
    assert_eq!(std::fs::read(a.join("config.json")).unwrap(), std::fs::read(b.join("config.json")).unwrap());
    assert_eq!(la.specs, lc.specs);
    let differ = la.data.iter().filter(|(k, v)| lc.data[*k] != **v).count();
    assert!(differ > la.data.len() * 9 / 10, "seed changes the values ({differ} of {} differ)", la.data.len());
}

#[test]
fn bad_config_names_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = builtin_config("qwen3.6-tiny").unwrap();
    c["text_config"].as_object_mut().unwrap().remove("hidden_size");
    let err = synthesize(&SynthOptions::new(c, tmp.path()), &indicatif::ProgressBar::hidden()).unwrap_err();
    match &err {
        Error::ConfigKey { key, .. } => assert_eq!(key, "text_config.hidden_size"),
        e => panic!("unexpected error {e}"),
    }
    let mut c = builtin_config("qwen3.6-tiny").unwrap();
    c["text_config"]["layer_types"][0] = json!("full_attention");
    let err = synthesize(&SynthOptions::new(c, tmp.path()), &indicatif::ProgressBar::hidden()).unwrap_err();
    assert!(matches!(&err, Error::ConfigKey { key, .. } if key == "text_config.layer_types[0]"), "{err}");
    let mut o = SynthOptions::new(odd_config(), tmp.path());
    o.bits = 3;
    assert!(matches!(synthesize(&o, &indicatif::ProgressBar::hidden()), Err(Error::Invalid(_))));
}

#[test]
fn a_vocabulary_too_small_for_a_tokenizer_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = odd_config();
    c["vocab_size"] = json!(200);
    let err = synthesize(&SynthOptions::new(c, tmp.path()), &indicatif::ProgressBar::hidden()).unwrap_err();
    assert!(err.to_string().contains("too small for a tokenizer"), "{err}");
    // Just enough room: the byte tokens and the nine control tokens a conversation needs.
    let mut c = odd_config();
    c["vocab_size"] = json!(265);
    let r = synthesize(&SynthOptions::new(c, tmp.path()), &indicatif::ProgressBar::hidden()).unwrap();
    assert_eq!(r.tokenizer, lily_model::synth::SynthTokenizer::CutDown { bpe: 256, special: 9 });
}

#[test]
fn builtins_are_listed() {
    assert_eq!(builtin_names(), ["qwen3.6-35b-a3b", "qwen3.6-tiny"]);
    for n in builtin_names() {
        assert!(builtin_config(n).is_some());
    }
    assert!(builtin_config("nope").is_none());
    let big =
        ModelConfig::from_json_str(&builtin_config("qwen3.6-35b-a3b").unwrap().to_string(), Path::new("x")).unwrap();
    assert_eq!((big.hidden_size, big.num_hidden_layers, big.num_experts, big.vocab_size), (2048, 40, 256, 248320));
    assert_eq!(big.eos_token_ids, vec![248044]);
}

/// Dequantised rows of a quantised module [rows, cols].
fn rows_of(l: &Loaded, path: &str, p: AffineParams) -> Vec<Vec<f32>> {
    let w = u32s(&l.data[&format!("{path}.weight")]);
    let s = bf16s(&l.data[&format!("{path}.scales")]);
    let b = bf16s(&l.data[&format!("{path}.biases")]);
    let shape = &l.specs[&format!("{path}.weight")].shape;
    let cols = shape[shape.len() - 1] * 32 / p.bits as usize;
    let (wpr, gpr) = (p.words_per_row(cols), p.groups_per_row(cols));
    (0..w.len() / wpr)
        .map(|r| {
            let mut out = vec![0f32; cols];
            dequantize_row_bf16(&w[r * wpr..(r + 1) * wpr], &s[r * gpr..(r + 1) * gpr], &b[r * gpr..(r + 1) * gpr], p, &mut out);
            out
        })
        .collect()
}

/// `router_skew` scales each router row by its gain, leaves every other tensor (and the routers'
/// codes) as the unskewed model has them, and makes the favoured experts win the top k several times
/// as often as the least favoured (counted over random unit-RMS inputs), where the even model's
/// counts are flat.
#[test]
fn router_skew_favours_some_experts_and_changes_nothing_else() {
    let (even, skewed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let cfg_json = builtin_config("qwen3.6-tiny").unwrap();
    let mut o = SynthOptions::new(cfg_json.clone(), even.path());
    o.seed = 3;
    synthesize(&o, &indicatif::ProgressBar::hidden()).unwrap();
    let mut o = SynthOptions::new(cfg_json, skewed.path());
    o.seed = 3;
    o.router_skew = 7.0;
    synthesize(&o, &indicatif::ProgressBar::hidden()).unwrap();
    let (a, b) = (load(even.path()), load(skewed.path()));
    let cfg = ModelConfig::from_dir(even.path()).unwrap();
    for (name, data) in &a.data {
        let is_router_affine = name.ends_with(".mlp.gate.scales") || name.ends_with(".mlp.gate.biases");
        assert_eq!(data != &b.data[name], is_router_affine, "{name}: changed by the skew = {}", data != &b.data[name]);
    }
    let p8 = AffineParams { bits: 8, group_size: 64 };
    let (e, k, h) = (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size);
    let mut rng = 12345u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    let xs: Vec<Vec<f32>> = (0..2000).map(|_| (0..h).map(|_| (next() * 3f64.sqrt()) as f32).collect()).collect();
    for layer in [0usize, 5] {
        let path = format!("language_model.model.layers.{layer}.mlp.gate");
        let (ra, rb) = (rows_of(&a, &path, p8), rows_of(&b, &path, p8));
        let norm = |r: &Vec<f32>| r.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
        // Row norms: the gains run from 1 to 8 (bf16 scales: within a few percent).
        let ratios: Vec<f64> = ra.iter().zip(&rb).map(|(x, y)| norm(y) / norm(x)).collect();
        let (lo, hi) = ratios.iter().fold((f64::MAX, 0f64), |(l, h), r| (l.min(*r), h.max(*r)));
        assert!((0.95..1.5).contains(&lo) && (6.5..8.5).contains(&hi), "layer {layer}: row gains {lo:.2}..{hi:.2}");
        let counts = |rows: &Vec<Vec<f32>>| {
            let mut c = vec![0usize; e];
            for x in &xs {
                let mut l: Vec<(f64, usize)> =
                    rows.iter().enumerate().map(|(i, r)| (r.iter().zip(x).map(|(w, v)| (*w as f64) * (*v as f64)).sum(), i)).collect();
                l.sort_by(|p, q| q.0.partial_cmp(&p.0).unwrap());
                for &(_, i) in &l[..k] {
                    c[i] += 1;
                }
            }
            c.sort();
            c
        };
        let (ca, cb) = (counts(&ra), counts(&rb));
        // Most / least chosen expert. (A linear router on zero-mean inputs cannot make an expert win
        // more than about half the time: wider logits win the top k when they are positive.)
        let spread = |c: &Vec<usize>| c[e - 1] as f64 / c[0].max(1) as f64;
        assert!(spread(&ca) < 1.6, "layer {layer}: even router, most/least chosen {:.2} ({ca:?})", spread(&ca));
        assert!(spread(&cb) > 3.0, "layer {layer}: skewed router, most/least chosen {:.2} ({cb:?})", spread(&cb));
        println!("layer {layer}: most/least chosen expert {:.2} even, {:.2} with skew 7; row gains {lo:.2}..{hi:.2}", spread(&ca), spread(&cb));
    }
    // A negative or non-finite skew is refused.
    let bad = tempfile::tempdir().unwrap();
    let mut o = SynthOptions::new(builtin_config("qwen3.6-tiny").unwrap(), bad.path());
    o.router_skew = -1.0;
    assert!(synthesize(&o, &indicatif::ProgressBar::hidden()).is_err());
}
