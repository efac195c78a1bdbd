//! The `lily` program as a user runs it: `lily score` against the stored references (this exact
//! interface is what the numerical-consistency checks call), `lily synth` then `lily score`, and
//! damaged checkpoints or inputs giving a clear error (naming the file and tensor), never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn fixture_names() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(fixtures())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("tokens.json").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    assert!(v.len() >= 2);
    v
}

fn lily(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lily")).args(args).output().unwrap()
}

fn ok_json(out: Output) -> Value {
    assert!(out.status.success(), "lily failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs lily expecting a clean failure; returns stderr.
fn fails(args: &[&str]) -> String {
    let out = lily(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "expected failure for {args:?}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "lily panicked: {err}");
    assert!(err.starts_with("error: "), "{err}");
    err
}

fn score(model: &Path, tokens: &Path, extra: &[&str]) -> Value {
    let (m, t) = (model.to_str().unwrap(), tokens.to_str().unwrap());
    let mut args = vec!["score", "--model", m, "--tokens", t, "--backend", "cpu"];
    args.extend_from_slice(extra);
    ok_json(lily(&args))
}

fn compare(ours: &Value, reference: &Path) {
    let r: Value = serde_json::from_str(&std::fs::read_to_string(reference).unwrap()).unwrap();
    assert_eq!(ours["positions"], r["positions"]);
    let (p, q) = (ours["perplexity"].as_f64().unwrap(), r["perplexity"].as_f64().unwrap());
    assert!((p - q).abs() / q < 1e-4, "perplexity {p} vs {q} ({})", reference.display());
    let (a, b) = (ours["argmax"].as_array().unwrap(), r["argmax"].as_array().unwrap());
    let same = a.iter().zip(b).filter(|(x, y)| x == y).count();
    assert!(same as f64 >= 0.98 * b.len() as f64, "argmax agrees at {same}/{}", b.len());
    let n = ours["token_logprobs"].as_array().unwrap().len();
    assert_eq!(n, ours["positions"].as_u64().unwrap() as usize);
}

#[test]
fn score_matches_the_references() {
    for name in fixture_names() {
        let dir = fixtures().join(&name);
        let tokens = dir.join("tokens.json");
        let v = score(&dir.join("mlx"), &tokens, &[]);
        compare(&v, &dir.join("ref_mlx.json"));
        // Small prefill chunks: the same numbers.
        let c = score(&dir.join("mlx"), &tokens, &["--chunk", "23"]);
        compare(&c, &dir.join("ref_mlx.json"));
        let b = score(&dir.join("hf"), &tokens, &["--keep-bf16"]);
        compare(&b, &dir.join("ref_hf.json"));
    }
}

/// A copy of a fixture checkpoint to damage.
fn copy_checkpoint(name: &str, sub: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixtures().join(name).join(sub)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

fn safetensors_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

/// Rewrites the file holding `name`, passing each tensor through `edit` (None drops it).
fn rewrite(dir: &Path, name: &str, edit: impl Fn(&str, safetensors::Dtype, Vec<usize>, Vec<u8>) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>) -> PathBuf {
    for path in safetensors_files(dir) {
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        if !st.names().contains(&name) {
            continue;
        }
        let mut kept = Vec::new();
        for (n, t) in st.tensors() {
            let r = if n == name { edit(&n, t.dtype(), t.shape().to_vec(), t.data().to_vec()) } else { Some((t.dtype(), t.shape().to_vec(), t.data().to_vec())) };
            if let Some(r) = r {
                kept.push((n, r));
            }
        }
        let views: Vec<(String, safetensors::tensor::TensorView)> = kept
            .iter()
            .map(|(n, (d, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let out = safetensors::serialize(views, None).unwrap();
        std::fs::write(&path, out).unwrap();
        return path;
    }
    panic!("no file holds {name}");
}

#[test]
fn damaged_checkpoints_are_clear_errors() {
    let name = &fixture_names()[0];
    let tokens = fixtures().join(name).join("tokens.json");
    let t = tokens.to_str().unwrap();
    let run = |dir: &Path| fails(&["score", "--model", dir.to_str().unwrap(), "--tokens", t, "--backend", "cpu"]);
    let a_log = "language_model.model.layers.0.linear_attn.A_log";
    let qkv = "language_model.model.layers.0.linear_attn.in_proj_qkv.weight";

    // Truncated file.
    let d = copy_checkpoint(name, "mlx");
    let f = safetensors_files(d.path()).pop().unwrap();
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 1000).unwrap();
    let e = run(d.path());
    assert!(e.contains("truncated") && e.contains(f.file_name().unwrap().to_str().unwrap()), "{e}");

    // Garbage header.
    let d = copy_checkpoint(name, "mlx");
    let f = safetensors_files(d.path()).remove(0);
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[8..24].copy_from_slice(b"this is not json");
    std::fs::write(&f, bytes).unwrap();
    assert!(run(d.path()).contains("not a valid safetensors file"));

    // A missing tensor: listed by the index but absent, or absent altogether.
    let d = copy_checkpoint(name, "mlx");
    let f = rewrite(d.path(), a_log, |_, _, _, _| None);
    if d.path().join("model.safetensors.index.json").exists() {
        let e = run(d.path());
        assert!(e.contains(a_log) && e.contains("not present") && e.contains(f.file_name().unwrap().to_str().unwrap()), "{e}");
        std::fs::remove_file(d.path().join("model.safetensors.index.json")).unwrap();
    }
    let e = run(d.path());
    assert!(e.contains(a_log) && e.contains("missing"), "{e}");

    // A wrong shape.
    let d = copy_checkpoint(name, "mlx");
    let f = rewrite(d.path(), qkv, |_, dt, s, b| Some((dt, vec![s[0] / 2, s[1] * 2], b)));
    let e = run(d.path());
    assert!(e.contains(qkv) && e.contains("shape") && e.contains(f.file_name().unwrap().to_str().unwrap()), "{e}");

    // A wrong dtype.
    let d = copy_checkpoint(name, "mlx");
    rewrite(d.path(), a_log, |_, _, s, b| Some((safetensors::Dtype::I32, s, b)));
    let e = run(d.path());
    assert!(e.contains(a_log) && e.contains("dtype"), "{e}");

    // No config.json; a config.json with a bad value.
    let d = copy_checkpoint(name, "mlx");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert!(run(d.path()).contains("config.json"));
    let d = copy_checkpoint(name, "mlx");
    let cfg = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    std::fs::write(d.path().join("config.json"), cfg.replacen("\"num_key_value_heads\"", "\"num_key_value_heads\": \"x\", \"ignored\"", 1)).unwrap();
    assert!(run(d.path()).contains("num_key_value_heads"));

    // Not a directory at all.
    assert!(run(Path::new("/nonexistent/model")).contains("/nonexistent/model"));
}

#[test]
fn bad_token_files_are_clear_errors() {
    let name = &fixture_names()[0];
    let model = fixtures().join(name).join("mlx");
    let m = model.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for (text, want) in [("[1, 2", "JSON array"), ("[5]", "at least 2"), ("[1, 99999999]", "outside the vocabulary"), ("[1, -3]", "JSON array")] {
        let f = tmp.path().join("t.json");
        std::fs::write(&f, text).unwrap();
        let e = fails(&["score", "--model", m, "--tokens", f.to_str().unwrap(), "--backend", "cpu"]);
        assert!(e.contains(want), "{text}: {e}");
    }
}

fn template_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../lily-template/tests/data")
}

#[test]
fn render_prints_what_transformers_renders() {
    let data = template_data();
    let mut checked = 0;
    for model in ["qwen36", "qwen35", "builtin"] {
        for e in std::fs::read_dir(data.join("expected").join(model)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_none_or(|x| x != "txt") {
                continue;
            }
            let req = data.join("requests").join(p.file_stem().unwrap()).with_extension("json");
            let out = lily(&["render", "--model", data.join("models").join(model).to_str().unwrap(), "--request", req.to_str().unwrap()]);
            assert!(out.status.success(), "{}: {}", req.display(), String::from_utf8_lossy(&out.stderr));
            assert_eq!(String::from_utf8(out.stdout).unwrap(), std::fs::read_to_string(&p).unwrap(), "{}", p.display());
            checked += 1;
        }
    }
    assert!(checked >= 60, "only {checked} renders compared");
    // A template error reaches the user as a clear error.
    let bad = data.join("requests").join("03_developer.json");
    let e = fails(&["render", "--model", data.join("models/qwen36").to_str().unwrap(), "--request", bad.to_str().unwrap()]);
    assert!(e.contains("Unexpected message role"), "{e}");
}

#[test]
fn tokenize_round_trips() {
    use std::io::Write;
    // The real Qwen3.5/3.6 tokenizer.
    let dir = tempfile::tempdir().unwrap();
    let gz = std::fs::File::open(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.6-tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(gz), &mut json).unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
    let model = dir.path().to_path_buf();
    let text = "Hello, wereld! 你好 🦀 <|im_start|>user\nfn main() {}<|im_end|>\n";
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["tokenize", "--model", model.to_str().unwrap()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let ids: Vec<u32> = serde_json::from_slice(&out.stdout).unwrap();
    assert!(ids.contains(&248045) && ids.contains(&248046), "special tokens are single ids: {ids:?}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["tokenize", "--model", model.to_str().unwrap(), "--decode"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(serde_json::to_string(&ids).unwrap().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), text);
}

#[test]
fn bench_reports_every_length_as_a_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let model = fixtures().join("tiny-b/mlx");
    let out = lily(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--backend",
        "cpu",
        "--lengths",
        "16,1K",
        "--decode-tokens",
        "3",
        "--repeats",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.lines().any(|l| l.starts_with("| 16 |")), "{table}");
    assert!(table.lines().any(|l| l.starts_with("| 1024 |")), "{table}");
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["backend"], "cpu");
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["length"].as_u64().unwrap()).collect::<Vec<_>>(), vec![16, 1024]);
    for r in rows {
        assert_eq!(r["prefill_seconds"].as_array().unwrap().len(), 2);
        assert_eq!(r["decode_seconds"].as_array().unwrap().len(), 2);
        assert!(r["prefill_tok_s"].as_f64().unwrap() > 0.0 && r["decode_tok_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn bench_and_score_refuse_bad_arguments_in_words() {
    let model = fixtures().join("tiny-b/mlx");
    let m = model.to_str().unwrap();
    for (args, want) in [
        (vec!["bench", "--model", m, "--lengths", "12x"], "is not a length"),
        (vec!["bench", "--model", m, "--decode-tokens", "0"], "--decode-tokens"),
        (vec!["bench", "--model", m, "--backend", "gpu"], "unknown backend"),
    ] {
        let out = lily(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// Without a GPU (or without the `cuda` feature), asking for CUDA is one clear line, not a panic.
#[test]
fn cuda_backend_without_a_gpu_is_a_clear_error() {
    if std::path::Path::new("/dev/nvidia0").exists() {
        return; // a GPU machine: the CUDA backend may well open
    }
    let model = fixtures().join("tiny-b/mlx");
    let tokens = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(tokens.path(), "[1, 2, 3]").unwrap();
    let out = lily(&["score", "--backend", "cuda", "--model", model.to_str().unwrap(), "--tokens", tokens.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("CUDA"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn run_with_a_json_schema_answers_valid_json() {
    let dir = tempfile::tempdir().unwrap();
    let schema = serde_json::json!({"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": false});
    let path = dir.path().join("schema.json");
    std::fs::write(&path, schema.to_string()).unwrap();
    let model = fixtures().join("tiny-b/mlx");
    let (m, p) = (model.to_str().unwrap(), path.to_str().unwrap());
    for seed in ["1", "2", "3"] {
        let out = lily(&["run", "--model", m, "--backend", "cpu", "--prompt", "Where to?", "--no-think", "--temperature", "1", "--seed", seed, "--json-schema", p]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let v: Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {text:?}"));
        assert!(["Paris", "Rome"].contains(&v["city"].as_str().unwrap()), "{v}");
        assert!((1..=9).contains(&v["days"].as_i64().unwrap()), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    }
    // --json: any object (tiny-b's 368-token vocabulary closes its strings soon enough).
    for seed in ["1", "2", "3"] {
        let out = lily(&["run", "--model", m, "--backend", "cpu", "--prompt", "Hi", "--no-think", "--max-tokens", "3000", "--temperature", "1", "--seed", seed, "--json"]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success() && err.contains(", stop]"), "{err}");
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(serde_json::from_str::<Value>(text.trim()).unwrap_or_else(|e| panic!("{e}: {text:?}")).is_object(), "{text:?}");
    }
    // A bad schema, or one that is not JSON, is an error naming the file.
    std::fs::write(&path, r#"{"type": "integer", "minimum": 3, "maximum": 1}"#).unwrap();
    let err = fails(&["run", "--model", m, "--backend", "cpu", "--prompt", "x", "--json-schema", p]);
    assert!(err.contains("--json-schema") && err.contains("schema.json") && err.contains("minimum"), "{err}");
    std::fs::write(&path, "{not json").unwrap();
    let err = fails(&["run", "--model", m, "--backend", "cpu", "--prompt", "x", "--json-schema", p]);
    assert!(err.contains("not valid JSON"), "{err}");
}

/// Runs lily with `input` on stdin.
fn lily_stdin(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn synth_of_a_fixture_config_writes_a_model_that_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let cfg = fixtures().join("tiny-b/hf/config.json");
    let o = lily(&["synth", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // Words, not a Rust debug dump.
    assert!(!err.contains("SynthReport") && !err.contains("files: [") && !err.contains('{'), "{err}");
    assert!(err.contains("parameters") && err.contains("tokenizer: the Qwen3.5/3.6 tokenizer cut down"), "{err}");
    // The tokenizer fits the 384-row vocabulary, and lily run answers with it.
    let m = out.to_str().unwrap();
    let o = lily(&["run", "-m", m, "--backend", "cpu", "-n", "8", "--temp", "0", "Hello there"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("8 generated") || e.contains(", stop]"), "{e}");
    let ids = lily_stdin(&["tokenize", "-m", m], "Hello, wörld! 🦀 <|im_start|>user");
    let ids: Vec<u32> = serde_json::from_slice(&ids.stdout).unwrap();
    assert!(ids.iter().all(|&i| i < 384), "{ids:?}");
}

#[test]
fn run_takes_the_prompt_as_an_argument_an_option_or_stdin() {
    let m = fixtures().join("tiny-a/mlx");
    let m = m.to_str().unwrap();
    let base = ["run", "-m", m, "--backend", "cpu", "-n", "3", "--temp", "0"];
    let with = |extra: &[&str]| -> Vec<String> { base.iter().chain(extra).map(|s| s.to_string()).collect() };
    let speed = |o: &Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        e.lines().last().unwrap().to_string()
    };
    // The same prompt three ways: the same prompt length.
    let run = |extra: &[&str]| lily(&with(extra).iter().map(String::as_str).collect::<Vec<_>>());
    let run_stdin = |extra: &[&str], input: &str| lily_stdin(&with(extra).iter().map(String::as_str).collect::<Vec<_>>(), input);
    let a = speed(&run(&["Hello there"]));
    let b = speed(&run(&["-p", "Hello there"]));
    let c = speed(&run_stdin(&["-"], "Hello there"));
    let prompt_tokens = |l: &str| l.split(" prompt tokens").next().unwrap().trim_start_matches('[').to_string();
    assert_eq!(prompt_tokens(&a), prompt_tokens(&b));
    assert_eq!(prompt_tokens(&a), prompt_tokens(&c), "{a} / {c}");
    // No prompt, an empty one, or two: clear errors.
    assert!(fails(&base).contains("no prompt"));
    let o = run_stdin(&["-"], "  \n");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("empty"));
    let o = run(&["a", "-p", "b"]);
    assert!(!o.status.success());
}

#[test]
fn render_reads_the_request_from_stdin() {
    let data = template_data();
    let model = data.join("models/qwen36");
    let req = data.join("requests").join("01_plain.json");
    let from_file = lily(&["render", "--model", model.to_str().unwrap(), "--request", req.to_str().unwrap()]);
    let from_stdin = lily_stdin(&["render", "--model", model.to_str().unwrap(), "--request", "-"], &std::fs::read_to_string(&req).unwrap());
    assert!(from_stdin.status.success(), "{}", String::from_utf8_lossy(&from_stdin.stderr));
    assert_eq!(from_file.stdout, from_stdin.stdout);
    let bad = lily_stdin(&["render", "--model", model.to_str().unwrap(), "--request", "-"], "{nope");
    let e = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && e.contains("stdin") && e.contains("not valid JSON"), "{e}");
}

#[test]
fn a_missing_model_directory_is_said_once() {
    for args in [
        vec!["run", "-m", "/nonexistent/model", "hi"],
        vec!["info", "-m", "/nonexistent/model"],
        vec!["score", "-m", "/nonexistent/model", "--tokens", "/nonexistent/t.json"],
        vec!["serve", "-m", "/nonexistent/model", "--port", "0"],
    ] {
        let e = fails(&args);
        assert_eq!(e.trim_end(), "error: /nonexistent/model: no such directory", "{args:?}");
    }
    let file = fixtures().join("tiny-a/tokens.json");
    assert!(fails(&["info", "-m", file.to_str().unwrap()]).contains("not a directory"));
    // An error that carries its cause says it once, not "...: No such file (os error 2): No such file (os error 2)".
    let d = tempfile::tempdir().unwrap();
    let e = fails(&["info", "-m", d.path().to_str().unwrap()]);
    assert_eq!(e.matches("No such file or directory").count(), 1, "{e}");
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn info_speaks_plain_words() {
    let m = fixtures().join("tiny-a/mlx");
    let o = lily(&["info", "-m", m.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    for want in ["parameters", "in all", "used per token", "MLX affine 4-bit, groups of 64", "on disk", "in memory", "up to 4,096 tokens", "512 tokens", "chat template"] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    assert!(!text.contains("MlxAffine") && !text.contains("Some("), "{text}");
    let h = fixtures().join("tiny-a/hf");
    let text = String::from_utf8(lily(&["info", "-m", h.to_str().unwrap()]).stdout).unwrap();
    assert!(text.contains("Hugging Face bf16") && text.contains("7 safetensors files"), "{text}");
}
