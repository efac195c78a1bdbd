//! Damaged safetensors headers (the cases `fuzz/` checks at random, and those it found): each one is
//! a clear error naming the file, never a panic, an overflow or a tensor accepted with the wrong size.

use std::path::Path;

use lily_model::checkpoint::Checkpoint;

/// A directory holding one `model.safetensors` made of `header` (its length field right) and `data`.
fn with_header(header: &str, data: &[u8]) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header.as_bytes());
    f.extend_from_slice(data);
    std::fs::write(d.path().join("model.safetensors"), f).unwrap();
    d
}

fn error(dir: &Path) -> String {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("a damaged header was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_shape_whose_size_overflows_is_refused() {
    // 2^62 × 8 × 4 bytes wraps to 0 in usize: it must not pass for the zero bytes it has.
    for shape in ["[4611686018427387904, 8]", "[18446744073709551615, 2]", "[4294967296, 4294967296]"] {
        let d = with_header(&format!(r#"{{"t": {{"dtype": "F32", "shape": {shape}, "data_offsets": [0, 0]}}}}"#), &[]);
        let e = error(d.path());
        assert!(e.contains("model.safetensors") && e.contains("`t`") && e.contains("larger than any file"), "{shape}: {e}");
    }
}

#[test]
fn other_damage_is_named() {
    for (header, want) in [
        (r#"{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}"#, "needs 8"),
        (r#"{"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}"#, "corrupt header"),
        (r#"{"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}}"#, "data_offsets"),
        (r#"{"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}"#, "unsupported dtype"),
        (r#"{"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}"#, "shape"),
        (r#"{"t": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}"#, "truncated"),
        (r#"[1, 2]"#, "not a JSON object"),
        ("{\"t\": ", "not JSON"),
    ] {
        let d = with_header(header, &[0u8; 8]);
        let e = error(d.path());
        assert!(e.contains(want), "{header}: {e}");
    }
    // A length field past the end of the file.
    let d = tempfile::tempdir().unwrap();
    let mut f = u64::MAX.to_le_bytes().to_vec();
    f.extend_from_slice(b"{}");
    std::fs::write(d.path().join("model.safetensors"), f).unwrap();
    assert!(error(d.path()).contains("truncated"));
}
