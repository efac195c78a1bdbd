//! config.json parsing: both published forms, the layer pattern, RoPE and quantisation blocks, and
//! errors that name the key.

use std::path::Path;

use lily_model::{LayerKind, ModelConfig};
use serde_json::{json, Value};

fn text() -> Value {
    json!({
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 1024, "rms_norm_eps": 1e-6,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}
    })
}

fn parse(v: &Value) -> lily_model::Result<ModelConfig> {
    ModelConfig::from_json_str(&v.to_string(), Path::new("config.json"))
}

fn err(v: &Value) -> String {
    parse(v).unwrap_err().to_string()
}

#[test]
fn plain_and_multimodal_forms_agree() {
    let plain = parse(&text()).unwrap();
    let wrapped = parse(&json!({"model_type": "qwen3_5_moe", "text_config": text(), "vision_config": {"depth": 1}})).unwrap();
    assert_eq!(plain, wrapped);
    assert_eq!(plain.rotary_dim, 16);
    assert_eq!(plain.rope_theta, 1e7);
    assert_eq!(plain.linear_conv_dim(), 2 * 64 + 128);
    assert_eq!(
        plain.layer_types,
        vec![LayerKind::LinearAttention, LayerKind::LinearAttention, LayerKind::LinearAttention, LayerKind::FullAttention]
    );
}

#[test]
fn layer_types_win_over_the_interval() {
    let mut t = text();
    t["layer_types"] = json!(["full_attention", "linear_attention", "full_attention", "linear_attention"]);
    let c = parse(&t).unwrap();
    assert_eq!(c.layer_types[0], LayerKind::FullAttention);
    assert_eq!(c.num_full_attention_layers(), 2);
    t["layer_types"] = json!(["full_attention", "linear_attention", "sliding"]);
    let e = err(&t);
    assert!(e.contains("layer_types") && e.contains("3 entries"), "{e}");
    t["layer_types"] = json!(["full_attention", "linear_attention", "sliding", "full_attention"]);
    let e = err(&t);
    assert!(e.contains("layer_types[2]"), "{e}");
}

#[test]
fn legacy_rope_keys() {
    let mut t = text();
    t.as_object_mut().unwrap().remove("rope_parameters");
    t["rope_theta"] = json!(10000.0);
    t["partial_rotary_factor"] = json!(0.5);
    let c = parse(&t).unwrap();
    assert_eq!((c.rope_theta, c.rotary_dim), (10000.0, 32));
}

#[test]
fn missing_and_wrong_values_name_the_key() {
    let mut t = text();
    t.as_object_mut().unwrap().remove("hidden_size");
    let e = err(&json!({"model_type": "qwen3_5_moe", "text_config": t}));
    assert!(e.contains("config.json") && e.contains("`text_config.hidden_size`") && e.contains("missing"), "{e}");

    let mut t = text();
    t["num_key_value_heads"] = json!("two");
    assert!(err(&t).contains("`num_key_value_heads`"));

    let mut t = text();
    t["num_key_value_heads"] = json!(3);
    let e = err(&t);
    assert!(e.contains("num_key_value_heads") && e.contains("does not divide"), "{e}");

    let mut t = text();
    t["rope_parameters"]["rope_type"] = json!("yarn");
    assert!(err(&t).contains("rope_parameters.rope_type"));

    let mut t = text();
    t["model_type"] = json!("llama");
    assert!(err(&t).contains("model_type"));

    let mut t = text();
    t["num_experts_per_tok"] = json!(9);
    assert!(err(&t).contains("num_experts_per_tok"));

    assert!(ModelConfig::from_json_str("{not json", Path::new("c.json")).unwrap_err().to_string().contains("c.json"));
}

#[test]
fn quantization_block_with_overrides() {
    let q = json!({
        "group_size": 64, "bits": 4, "mode": "affine",
        "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
        "language_model.model.layers.1.mlp.gate": false
    });
    let c = parse(&json!({"model_type": "qwen3_5_moe", "text_config": text(), "quantization": q})).unwrap();
    let q = c.quantization.unwrap();
    assert_eq!(q.for_module("language_model.model.layers.0.mlp.gate"), Some((64, 8)));
    assert_eq!(q.for_module("language_model.model.layers.1.mlp.gate"), None);
    assert_eq!(q.for_module("language_model.model.layers.0.mlp.shared_expert.up_proj"), Some((64, 4)));

    let bad = json!({"model_type": "qwen3_5_moe", "text_config": text(), "quantization": {"group_size": 48, "bits": 4}});
    assert!(err(&bad).contains("quantization.group_size"));
    let bad = json!({"model_type": "qwen3_5_moe", "text_config": text(),
        "quantization": {"group_size": 64, "bits": 4, "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 3}}});
    assert!(err(&bad).contains("quantization.language_model.model.layers.0.mlp.gate.bits"));
}

#[test]
fn generation_config() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"bos_token_id":248044,"do_sample":true,"eos_token_id":[248046,248044],"pad_token_id":248044,"temperature":1.0,"top_k":20,"top_p":0.95}"#,
    )
    .unwrap();
    let g = lily_model::GenerationConfig::from_dir(dir.path()).unwrap();
    assert_eq!(g.eos_token_ids, vec![248046, 248044]);
    assert_eq!((g.top_k, g.top_p, g.temperature), (Some(20), Some(0.95), Some(1.0)));
    std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id":"x"}"#).unwrap();
    assert!(lily_model::GenerationConfig::from_dir(dir.path()).unwrap_err().to_string().contains("eos_token_id"));
}
