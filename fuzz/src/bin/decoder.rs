//! Fuzz target: the stream decoder fed arbitrary token ids. Every 3 bytes are an id below 248,080
//! (a few past the real tokenizer's 248,077, which must be refused), at most 4,096 of them (an
//! answer's worth: longer inputs only slow each run down); the last byte's low bit chooses whether
//! control tokens are skipped. Checked, for the byte-level decoder: the pieces
//! pushed out plus the flush are exactly the tokenizer's decode of the known ids; an unknown id is
//! an error that leaves the decoder as it was. The generic (windowed) decoder must not panic.

use lily_tokenizer::StreamDecoder;

fn main() {
    let tok = lily_fuzz::tokenizer();
    afl::fuzz!(|data: &[u8]| {
        let skip = data.last().is_some_and(|b| b & 1 == 1);
        let ids: Vec<u32> = data.chunks_exact(3).take(4096).map(|c| u32::from_le_bytes([c[0], c[1], c[2], 0]) % 248_080).collect();
        let mut d = StreamDecoder::new(tok, skip);
        let mut w = StreamDecoder::new_windowed(tok, skip);
        let mut text = String::new();
        let mut known = Vec::new();
        for &id in &ids {
            match d.push(id) {
                Ok(piece) => {
                    text.push_str(&piece);
                    known.push(id);
                }
                Err(_) => assert!(id as usize >= tok.vocab_size(), "id {id} refused"),
            }
            let _ = w.push(id);
        }
        text.push_str(&d.flush());
        let _ = w.flush();
        let want = tok.decode(&known, skip).unwrap();
        assert_eq!(text, want, "ids {known:?}");
    });
}
