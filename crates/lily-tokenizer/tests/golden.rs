//! The real Qwen3.5/3.6 tokenizer against golden ids from the Python reference
//! (`tools/tokenizer_reference.py` -> `tests/data/golden.json`), and the streaming decoder on the
//! same corpus.

use std::io::Read;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use lily_tokenizer::{StreamDecoder, Tokenizer};
use serde_json::Value;

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The uncompressed tokenizer.json (33 MB), read once.
fn tokenizer_json() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let gz = manifest().join("../../assets/qwen3.6-tokenizer.json.gz");
        let file = std::fs::File::open(&gz).unwrap_or_else(|e| panic!("{}: {e}", gz.display()));
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(file).read_to_end(&mut out).unwrap();
        out
    })
}

/// The real tokenizer, loaded once the way a checkpoint is: `from_dir` on a directory holding
/// tokenizer.json and a Qwen-style tokenizer_config.json.
fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let json = tokenizer_json();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
        std::fs::copy(manifest().join("tests/data/tokenizer_config.json"), dir.path().join("tokenizer_config.json")).unwrap();
        let t0 = Instant::now();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        eprintln!("Tokenizer::from_dir (33 MB tokenizer.json): {:.0} ms", t0.elapsed().as_secs_f64() * 1e3);
        tok
    })
}

struct Piece {
    name: String,
    text: String,
    ids: Vec<u32>,
    decoded: String,
    decoded_skip: String,
}

fn golden() -> &'static [Piece] {
    static G: OnceLock<Vec<Piece>> = OnceLock::new();
    G.get_or_init(|| {
        let path = manifest().join("tests/data/golden.json");
        let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        v["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let text = p["text"].as_str().unwrap().to_string();
                let decoded = p.get("decoded").map_or(text.clone(), |d| d.as_str().unwrap().to_string());
                let decoded_skip =
                    p.get("decoded_skip_special").map_or(decoded.clone(), |d| d.as_str().unwrap().to_string());
                Piece {
                    name: p["name"].as_str().unwrap().to_string(),
                    text,
                    ids: p["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
                    decoded,
                    decoded_skip,
                }
            })
            .collect()
    })
}

#[test]
fn golden_file_is_what_we_expect() {
    let v: Value = serde_json::from_slice(&std::fs::read(manifest().join("tests/data/golden.json")).unwrap()).unwrap();
    assert_eq!(v["vocab_size"], 248077);
    assert!(golden().len() >= 60, "{} pieces", golden().len());
}

#[test]
fn encode_matches_reference_ids() {
    let tok = tok();
    let mut bad = Vec::new();
    for p in golden() {
        let ids = tok.encode(&p.text).unwrap();
        if ids != p.ids {
            bad.push(format!("{}: got {:?}\n  want {:?}", p.name, ids, p.ids));
        }
    }
    assert!(bad.is_empty(), "{} of {} pieces differ:\n{}", bad.len(), golden().len(), bad.join("\n"));
}

#[test]
fn decode_matches_reference_text() {
    let tok = tok();
    for p in golden() {
        assert_eq!(tok.decode(&p.ids, false).unwrap(), p.decoded, "{}", p.name);
        assert_eq!(tok.decode(&p.ids, true).unwrap(), p.decoded_skip, "{}", p.name);
    }
}

#[test]
fn readme_known_ids() {
    let tok = tok();
    assert_eq!(
        tok.encode("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ").unwrap(),
        [
            9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97, 91914, 28495,
            68933, 128, 105, 68933, 128, 95
        ]
    );
    assert_eq!(
        tok.encode("<|im_start|>user\nhi<|im_end|>\n<think>\n").unwrap(),
        [248045, 846, 198, 5834, 248046, 198, 248068, 198]
    );
}

#[test]
fn nfc_normalisation() {
    let tok = tok();
    // NFD input encodes like its NFC form, and decodes to the NFC form.
    let nfc = "café naïve Ångström Tiếng Việt 한국어";
    let nfd = "cafe\u{301} nai\u{308}ve A\u{30a}ngstro\u{308}m Tie\u{302}\u{301}ng Vie\u{323}\u{302}t \u{1112}\u{1161}\u{11ab}\u{1100}\u{116e}\u{11a8}\u{110b}\u{1165}";
    assert_eq!(tok.encode(nfd).unwrap(), tok.encode(nfc).unwrap());
    assert_eq!(tok.decode(&tok.encode(nfd).unwrap(), false).unwrap(), nfc);
    // singleton decompositions: Angstrom sign -> Å, Ohm sign -> Ω
    assert_eq!(tok.decode(&tok.encode("\u{212b}\u{2126}").unwrap(), false).unwrap(), "\u{c5}\u{3a9}");
}

#[test]
fn special_and_added_tokens() {
    let tok = tok();
    assert_eq!(tok.vocab_size(), 248077);
    let table = [
        ("<|endoftext|>", 248044, true),
        ("<|im_start|>", 248045, true),
        ("<|im_end|>", 248046, true),
        ("<|vision_start|>", 248053, true),
        ("<tool_call>", 248058, false),
        ("</tool_call>", 248059, false),
        ("<|fim_prefix|>", 248060, true),
        ("<tool_response>", 248066, false),
        ("</tool_response>", 248067, false),
        ("<think>", 248068, false),
        ("</think>", 248069, false),
        ("<|audio_pad|>", 248076, true),
    ];
    for (token, id, special) in table {
        assert_eq!(tok.token_id(token), Some(id), "{token}");
        assert_eq!(tok.token(id).as_deref(), Some(token));
        assert_eq!(tok.is_special(id), special, "{token}");
        // written in text, every added token is one id
        assert_eq!(tok.encode(token).unwrap(), [id], "{token}");
    }
    let n_special = (0..tok.vocab_size() as u32).filter(|&id| tok.is_special(id)).count();
    assert_eq!(n_special, 33 - 6);
    assert!(!tok.is_special(0) && !tok.is_special(248043));
    assert_eq!(tok.token_id("Ġthe"), Some(279));
    assert_eq!(tok.eos_ids(), [248046]);
    assert_eq!(tok.pad_id(), Some(248044));
    assert_eq!(tok.bos_id(), None);
    // no BOS, no post-processor: the empty string is no ids
    assert!(tok.encode("").unwrap().is_empty());
    // skip_special keeps <think> and <tool_call>
    let ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\nx\n</tool_call><|im_end|>").unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "assistant\n<think>\nhm\n</think>\n\n<tool_call>\nx\n</tool_call>");
    // look-alikes are plain text
    assert!(tok.encode("<|im_start").unwrap().iter().all(|&id| id < 248044));
}

#[test]
fn without_config_defaults() {
    // from_json_bytes: no tokenizer_config.json -> ChatML stop tokens, same encoding.
    let t0 = Instant::now();
    let tok = Tokenizer::from_json_bytes(tokenizer_json()).unwrap();
    eprintln!("Tokenizer::from_json_bytes: {:.0} ms", t0.elapsed().as_secs_f64() * 1e3);
    assert_eq!(tok.eos_ids(), [248046, 248044]);
    assert_eq!(tok.pad_id(), Some(248044));
    assert_eq!(tok.bos_id(), None);
    assert!(tok.is_special(248046) && !tok.is_special(248068));
    for p in golden().iter().step_by(7) {
        assert_eq!(tok.encode(&p.text).unwrap(), p.ids, "{}", p.name);
    }
}

#[test]
fn every_id_streams_like_decode() {
    // Every id round-trips through decode without error, and the stream decoder agrees with it
    // (single ids are often incomplete UTF-8: flush turns the tail into U+FFFD).
    let tok = tok();
    for id in 0..tok.vocab_size() as u32 {
        let want = tok.decode(&[id], false).unwrap();
        let mut s = StreamDecoder::new(tok, false);
        let mut got = s.push(id).unwrap();
        got.push_str(&s.flush());
        assert_eq!(got, want, "id {id}");
    }
}

fn stream(tok: &Tokenizer, ids: &[u32], skip: bool, windowed: bool) -> (String, Vec<String>) {
    let mut s = if windowed { StreamDecoder::new_windowed(tok, skip) } else { StreamDecoder::new(tok, skip) };
    let mut chunks = Vec::new();
    for &id in ids {
        chunks.push(s.push(id).unwrap());
    }
    chunks.push(s.flush());
    (chunks.concat(), chunks)
}

#[test]
fn streaming_equals_full_decode_on_corpus() {
    let tok = tok();
    for p in golden() {
        for skip in [false, true] {
            let want = tok.decode(&p.ids, skip).unwrap();
            let (got, chunks) = stream(tok, &p.ids, skip, false);
            assert_eq!(got, want, "{} skip={skip}", p.name);
            // valid text never arrives late: all is emitted before the flush
            assert_eq!(chunks.last().unwrap(), "", "{} skip={skip}: flush returned text", p.name);
            let (got_w, _) = stream(tok, &p.ids, skip, true);
            assert_eq!(got_w, want, "{} skip={skip} (windowed)", p.name);
        }
    }
}

#[test]
fn streaming_holds_back_partial_characters() {
    let tok = tok();
    // "😀" is 4 bytes; byte-level BPE without context gives several tokens for some emoji
    for text in ["🫨", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "\u{11f04}", "👨‍👩‍👧‍👦", "毕"] {
        let ids = tok.encode(text).unwrap();
        let mut s = StreamDecoder::new(tok, false);
        let mut out = String::new();
        for &id in &ids {
            let chunk = s.push(id).unwrap();
            assert!(!chunk.contains('\u{FFFD}'), "{text}: partial char emitted");
            out.push_str(&chunk);
        }
        assert_eq!(s.flush(), "");
        assert_eq!(out, text);
    }
    // A 4-byte char split into byte tokens: nothing until the last byte.
    let bytes = "🫨".as_bytes();
    let ids: Vec<u32> = bytes.iter().map(|&b| byte_token(tok, b)).collect();
    let mut s = StreamDecoder::new(tok, false);
    assert_eq!(s.push(ids[0]).unwrap(), "");
    assert_eq!(s.push(ids[1]).unwrap(), "");
    assert_eq!(s.push(ids[2]).unwrap(), "");
    assert_eq!(s.push(ids[3]).unwrap(), "🫨");
    // Stopping in the middle of a character: flush gives U+FFFD like decode, nothing is lost.
    let mut s = StreamDecoder::new(tok, true);
    let head = tok.encode("ok ").unwrap();
    let mut out = String::new();
    for &id in &head {
        out.push_str(&s.push(id).unwrap());
    }
    out.push_str(&s.push(ids[0]).unwrap());
    out.push_str(&s.push(ids[1]).unwrap());
    out.push_str(&s.push(248046).unwrap()); // <|im_end|>, skipped
    out.push_str(&s.flush());
    let mut all = head.clone();
    all.extend([ids[0], ids[1], 248046]);
    assert_eq!(out, tok.decode(&all, true).unwrap());
    assert_eq!(out, "ok \u{FFFD}");
    // and without skipping, the special token follows the U+FFFD
    let (got, _) = stream(tok, &all, false, false);
    assert_eq!(got, "ok \u{FFFD}<|im_end|>");
    assert_eq!(got, tok.decode(&all, false).unwrap());
}

/// The id of the single-byte token for byte `b`.
fn byte_token(tok: &Tokenizer, b: u8) -> u32 {
    // GPT-2 bytes_to_unicode
    let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let c = if printable {
        char::from(b)
    } else {
        let n = (0..b)
            .filter(|&x| !((0x21..=0x7e).contains(&x) || (0xa1..=0xac).contains(&x) || (0xae..=0xff).contains(&x)))
            .count() as u32;
        char::from_u32(0x100 + n).unwrap()
    };
    tok.token_id(&c.to_string()).unwrap()
}

/// Small deterministic PRNG (xorshift64*), to avoid a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn streaming_equals_full_decode_on_random_ids() {
    // Random ids: random BPE tokens, raw byte tokens (mostly invalid UTF-8), added tokens.
    let tok = tok();
    let byte_ids: Vec<u32> = (0..=255u8).map(|b| byte_token(tok, b)).collect();
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for case in 0..300 {
        let len = 1 + rng.below(60) as usize;
        let ids: Vec<u32> = (0..len)
            .map(|_| match rng.below(10) {
                0..=4 => byte_ids[rng.below(256) as usize],
                5 => byte_ids[0x80 + rng.below(0x80) as usize],
                6 => 248044 + rng.below(33) as u32,
                _ => rng.below(248044) as u32,
            })
            .collect();
        for skip in [false, true] {
            let want = tok.decode(&ids, skip).unwrap();
            let (got, _) = stream(tok, &ids, skip, false);
            assert_eq!(got, want, "case {case} skip={skip} ids {ids:?}");
        }
    }
}

#[test]
fn streaming_cost_is_flat() {
    // O(1) per token: stream ~200k tokens and report the rate (a quadratic decoder would take
    // minutes here).
    let tok = tok();
    let mut ids = Vec::new();
    while ids.len() < 200_000 {
        for p in golden() {
            ids.extend_from_slice(&p.ids);
        }
    }
    let t0 = Instant::now();
    let mut s = StreamDecoder::new(tok, false);
    let mut n = 0usize;
    for &id in &ids {
        n += s.push(id).unwrap().len();
    }
    n += s.flush().len();
    let dt = t0.elapsed().as_secs_f64();
    let full = tok.decode(&ids, false).unwrap();
    assert_eq!(n, full.len());
    eprintln!("streamed {} tokens in {:.1} ms ({:.2} µs/token)", ids.len(), dt * 1e3, dt * 1e6 / ids.len() as f64);
    assert!(dt < 10.0, "streaming took {dt} s");
}

#[test]
fn encode_throughput() {
    let tok = tok();
    let text: String = golden().iter().map(|p| p.text.as_str()).collect::<Vec<_>>().join("\n").repeat(20);
    let t0 = Instant::now();
    let ids = tok.encode(&text).unwrap();
    let dt = t0.elapsed().as_secs_f64();
    eprintln!(
        "encoded {} bytes -> {} ids in {:.1} ms ({:.1} MB/s)",
        text.len(),
        ids.len(),
        dt * 1e3,
        text.len() as f64 / dt / 1e6
    );
    let want: String = golden().iter().map(|p| p.decoded.as_str()).collect::<Vec<_>>().join("\n").repeat(20);
    assert_eq!(tok.decode(&ids, false).unwrap(), want);
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<StreamDecoder<'static>>();
}

#[test]
fn encode_after_equals_encoding_the_whole_text() {
    let tok = tok();
    let history = "<|im_start|>system\nDu bist hilfreich. 你好<|im_end|>\n<|im_start|>user\nCafé 🦀<|im_end|>\n";
    let ids = tok.encode(history).unwrap();
    for rest in ["<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=f>\n", "plain text after", " é"] {
        let whole = tok.encode(&format!("{history}{rest}")).unwrap();
        assert_eq!(tok.encode_after(history, &ids, rest).unwrap(), whole, "{rest:?}");
    }
}
