//! Error cases and tokenizer_config.json handling, on the small byte-level BPE tokenizer of the
//! `tests/fixtures/tiny-a` checkpoint (415 BPE tokens + 5 added tokens) and on broken files.

use std::path::PathBuf;

use lily_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-a/hf")
}

fn tiny_json() -> Vec<u8> {
    std::fs::read(tiny_dir().join("tokenizer.json")).unwrap()
}

#[test]
fn tiny_checkpoint_loads_with_its_config() {
    let tok = Tokenizer::from_dir(&tiny_dir()).unwrap();
    assert_eq!(tok.vocab_size(), 420);
    assert_eq!(tok.token_id("<|im_end|>"), Some(417));
    assert_eq!(tok.eos_ids(), [417]); // eos_token "<|im_end|>"
    assert_eq!(tok.pad_id(), Some(415)); // pad_token "<|endoftext|>"
    assert_eq!(tok.bos_id(), None);
    // in this fixture <think> is flagged special in tokenizer.json
    assert!(tok.is_special(418));
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>").unwrap();
    assert_eq!(ids[0], 416);
    assert_eq!(*ids.last().unwrap(), 417);
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>user\nhi<|im_end|>");
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
    let dbg = format!("{tok:?}");
    assert!(dbg.contains("vocab_size: 420"), "{dbg}");
}

#[test]
fn missing_dir_names_tokenizer_json() {
    let err = Tokenizer::from_dir(std::path::Path::new("/nonexistent/lily-model")).unwrap_err();
    assert!(matches!(err, TokenizerError::Io { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("/nonexistent/lily-model/tokenizer.json"), "{msg}");
    assert!(std::error::Error::source(&err).is_some());
}

#[test]
fn invalid_tokenizer_json_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, b"{\"model\": 42").unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::InvalidTokenizer { .. }), "{err:?}");
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");

    let err = Tokenizer::from_json_bytes(b"not json").unwrap_err();
    assert!(matches!(err, TokenizerError::InvalidTokenizer { .. }), "{err:?}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    let err = Tokenizer::from_json_bytes(b"{}").unwrap_err();
    assert!(matches!(err, TokenizerError::InvalidTokenizer { .. }), "{err:?}");
}

fn with_config(cfg: &str) -> Result<Tokenizer, TokenizerError> {
    Tokenizer::from_json_bytes_with_config(&tiny_json(), Some(cfg.as_bytes()))
}

#[test]
fn invalid_config_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), tiny_json()).unwrap();
    let cfg = dir.path().join("tokenizer_config.json");
    std::fs::write(&cfg, b"{ nope").unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::InvalidConfig { .. }), "{err:?}");
    assert!(err.to_string().contains(&cfg.display().to_string()), "{err}");

    for bad in [
        r#"[1, 2]"#,
        r#"{"eos_token": "<|no_such_token|>"}"#,
        r#"{"eos_token": 5}"#,
        r#"{"added_tokens_decoder": {"417": {"content": "<|im_start|>", "special": true}}}"#,
        r#"{"added_tokens_decoder": {"x": {"content": "<|im_start|>"}}}"#,
    ] {
        let err = with_config(bad).unwrap_err();
        assert!(matches!(err, TokenizerError::InvalidConfig { .. }), "{bad}: {err:?}");
    }
}

#[test]
fn config_fields() {
    // eos as an AddedToken object, bos set, added_tokens_decoder overriding the special flag,
    // an entry for an id tokenizer.json lacks (ignored).
    let tok = with_config(
        r#"{"eos_token": {"content": "<|endoftext|>", "special": true}, "bos_token": "<|im_start|>",
            "pad_token": null,
            "added_tokens_decoder": {"418": {"content": "<think>", "special": false},
                                     "999": {"content": "<extra>", "special": true}}}"#,
    )
    .unwrap();
    assert_eq!(tok.eos_ids(), [415]);
    assert_eq!(tok.bos_id(), Some(416));
    assert_eq!(tok.pad_id(), None);
    assert!(!tok.is_special(418));
    let ids = tok.encode("a<think>b").unwrap();
    assert!(ids.contains(&418));
    assert_eq!(tok.decode(&ids, true).unwrap(), "a<think>b");

    // no config: ChatML stop tokens
    let tok = Tokenizer::from_json_bytes(&tiny_json()).unwrap();
    assert_eq!(tok.eos_ids(), [417, 415]);

    // split_special_tokens: special tokens in the text are plain text
    let tok = with_config(r#"{"split_special_tokens": true}"#).unwrap();
    assert!(!tok.encode("<|im_end|>").unwrap().contains(&417));
}

#[test]
fn unknown_ids_are_errors() {
    let tok = Tokenizer::from_dir(&tiny_dir()).unwrap();
    for id in [420u32, 511, u32::MAX] {
        let err = tok.decode(&[1, id, 2], false).unwrap_err();
        match err {
            TokenizerError::UnknownId { id: got, vocab_size } => {
                assert_eq!((got, vocab_size), (id, 420));
            }
            e => panic!("{e:?}"),
        }
        assert!(tok.decode(&[id], true).is_err());
        assert!(tok.token(id).is_none());
        // the stream decoder rejects it and stays usable
        let mut s = StreamDecoder::new(&tok, false);
        let a = s.push(tok.token_id("h").unwrap()).unwrap();
        assert!(s.push(id).is_err());
        let b = s.push(tok.token_id("i").unwrap()).unwrap();
        assert_eq!(format!("{a}{b}{}", s.flush()), "hi");
    }
    let msg = tok.decode(&[420], false).unwrap_err().to_string();
    assert_eq!(msg, "token id 420 is out of range: the tokenizer knows ids 0..420");
}

#[test]
fn windowed_and_byte_decoders_agree_on_tiny() {
    let tok = Tokenizer::from_dir(&tiny_dir()).unwrap();
    let text = "<|im_start|>user\nhé 😀 毕\r\n\t<think>x</think><|im_end|>";
    let ids = tok.encode(text).unwrap();
    for skip in [false, true] {
        let want = tok.decode(&ids, skip).unwrap();
        for windowed in [false, true] {
            let mut s = if windowed { StreamDecoder::new_windowed(&tok, skip) } else { StreamDecoder::new(&tok, skip) };
            let mut got = String::new();
            for &id in &ids {
                got.push_str(&s.push(id).unwrap());
            }
            got.push_str(&s.flush());
            assert_eq!(got, want, "skip={skip} windowed={windowed}");
            // flush resets: the decoder can be reused
            let again: String = ids.iter().map(|&id| s.push(id).unwrap()).collect::<String>() + &s.flush();
            assert_eq!(again, want);
        }
    }
}

/// Found by `fuzz/decoder`: a long run of ids whose text ends in an invalid sequence (here lone
/// UTF-8 continuation bytes) kept the generic decoder silent, its window and each push's work
/// growing with the run (quadratic: 4,000 ids took seconds). The text now streams out as it comes,
/// still equal to `decode`.
#[test]
fn a_run_of_invalid_bytes_streams_out_and_matches_decode() {
    let tok = Tokenizer::from_dir(&tiny_dir()).unwrap();
    // The byte-level token of 0x80 (a continuation byte with no lead): 'Ģ' in GPT-2's byte alphabet.
    let cont = tok.token_id("\u{0122}").expect("the byte token of 0x80");
    let hi = tok.encode("hi").unwrap();
    let mut ids = hi.clone();
    ids.extend(std::iter::repeat_n(cont, 400));
    ids.extend(&hi);
    for skip in [false, true] {
        for windowed in [false, true] {
            let mut s = if windowed { StreamDecoder::new_windowed(&tok, skip) } else { StreamDecoder::new(&tok, skip) };
            let mut got = String::new();
            let mut spoke = 0;
            for &id in &ids {
                let piece = s.push(id).unwrap();
                spoke += usize::from(!piece.is_empty());
                got.push_str(&piece);
            }
            got.push_str(&s.flush());
            assert_eq!(got, tok.decode(&ids, skip).unwrap(), "windowed={windowed}");
            assert!(spoke >= 400 / 16, "windowed={windowed}: only {spoke} pushes gave text: held back until the end");
        }
    }
}
