//! Fuzz target: the checkpoint loader fed damaged safetensors headers. A real checkpoint (the tiny-c
//! fixture, MLX 4-bit) whose `model.safetensors` header is replaced by the fuzzer's bytes: the
//! first byte 0 keeps the length field right (the header is the rest), anything else takes the
//! next 8 bytes as the length field. The loader (headers, then every tensor the model needs, its
//! shape, dtype and bytes) must load or fail with an error, never panic or read out of bounds.

use std::path::PathBuf;
use std::sync::OnceLock;

struct Base {
    dir: PathBuf,
    /// The tensor bytes after the original header.
    data: Vec<u8>,
}

fn base() -> &'static Base {
    static B: OnceLock<Base> = OnceLock::new();
    B.get_or_init(|| {
        let src = lily_fuzz::repo().join("tests/fixtures/tiny-c/mlx");
        let shm = PathBuf::from("/dev/shm");
        let root = if shm.is_dir() { shm } else { std::env::temp_dir() };
        let dir = root.join(format!("lily-fuzz-checkpoint-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // No index: the loader reads the one file and looks for each tensor in it.
        for f in ["config.json", "generation_config.json"] {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        Base { dir, data: bytes[8 + n..].to_vec() }
    })
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some((&mode, rest)) = data.split_first() else { return };
        let b = base();
        let (len, header) = if mode == 0 || rest.len() < 8 {
            (rest.len() as u64, rest)
        } else {
            (u64::from_le_bytes(rest[..8].try_into().unwrap()), &rest[8..])
        };
        let mut file = Vec::with_capacity(8 + header.len() + b.data.len());
        file.extend_from_slice(&len.to_le_bytes());
        file.extend_from_slice(header);
        file.extend_from_slice(&b.data);
        std::fs::write(b.dir.join("model.safetensors"), &file).unwrap();
        let _ = lily_model::ModelWeights::load(&b.dir, &lily_model::LoadOptions::default());
    });
}
