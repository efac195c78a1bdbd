//! What the fuzz targets share: the real Qwen3.5/3.6 tokenizer (loaded once per process), the
//! repository's paths, and a splitter that turns the fuzzer's bytes into text pieces.

use std::path::PathBuf;
use std::sync::OnceLock;

/// The repository root (the fuzz crate lives in `fuzz/`).
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The real tokenizer of assets/, with Qwen's tokenizer_config (eos `<|im_end|>`).
pub fn tokenizer() -> &'static lily_tokenizer::Tokenizer {
    static TOK: OnceLock<lily_tokenizer::Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let gz = std::fs::read(repo().join("assets/qwen3.6-tokenizer.json.gz")).expect("assets/qwen3.6-tokenizer.json.gz");
        let mut json = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut json).unwrap();
        let config = br#"{"add_bos_token": false, "bos_token": null, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "split_special_tokens": false}"#;
        lily_tokenizer::Tokenizer::from_json_bytes_with_config(&json, Some(config)).unwrap()
    })
}

/// The fuzzer's bytes as text pieces: split at each 0x00 byte, each piece read as UTF-8 (invalid
/// bytes become U+FFFD, as a decoder would make them).
pub fn pieces(data: &[u8]) -> Vec<String> {
    data.split(|&b| b == 0).map(|p| String::from_utf8_lossy(p).into_owned()).collect()
}
