//! A checkpoint directory of safetensors files, memory-mapped: one `model.safetensors`, several
//! shards listed by `model.safetensors.index.json`, or every `*.safetensors` in the directory.
//! Headers are parsed and checked up front (offsets inside the file, byte counts matching shape and
//! dtype), so a truncated or corrupt file is a clear error naming the tensor and the file.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;
use serde_json::Value;

use crate::buf::Buf;
use crate::error::{Error, Result};

/// Element types a safetensors file may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    U16,
    I16,
    F16,
    BF16,
    U32,
    I32,
    F32,
    U64,
    I64,
    F64,
}

impl Dtype {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "BOOL" => Dtype::Bool,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "U16" => Dtype::U16,
            "I16" => Dtype::I16,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "U32" => Dtype::U32,
            "I32" => Dtype::I32,
            "F32" => Dtype::F32,
            "U64" => Dtype::U64,
            "I64" => Dtype::I64,
            "F64" => Dtype::F64,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::BF16 | Dtype::F32)
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", format!("{self:?}").to_uppercase())
    }
}

struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
}

#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    start: usize,
    end: usize,
}

/// An opened checkpoint: every tensor of every shard, by name.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, Entry>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::io(dir, std::io::Error::new(std::io::ErrorKind::NotFound, "not a checkpoint directory")));
        }
        let index = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = Vec::new();
        let mut expected: Vec<(String, String)> = Vec::new();
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: Value = serde_json::from_str(&text).map_err(|source| Error::Json { path: index.clone(), source })?;
            let Some(map) = v.get("weight_map").and_then(Value::as_object) else {
                return Err(Error::key(&index, "weight_map", "missing or not an object"));
            };
            for (name, file) in map {
                let Some(file) = file.as_str() else {
                    return Err(Error::key(&index, format!("weight_map.{name}"), "expected a file name"));
                };
                if !files.iter().any(|f| f.file_name().is_some_and(|n| n == file)) {
                    files.push(dir.join(file));
                }
                expected.push((name.clone(), file.to_string()));
            }
            files.sort();
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            for e in rd {
                let p = e.map_err(|e| Error::io(dir, e))?.path();
                if p.extension().is_some_and(|x| x == "safetensors") {
                    files.push(p);
                }
            }
            files.sort();
            if files.is_empty() {
                return Err(Error::io(
                    dir,
                    std::io::Error::new(std::io::ErrorKind::NotFound, "no *.safetensors files in this directory"),
                ));
            }
        }

        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: the checkpoint files are treated as read-only for the life of the process.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            for (name, entry) in parse_header(&path, &map, i)? {
                tensors.insert(name, entry);
            }
            shards.push(Shard { path, map: Arc::new(map) });
        }
        for (name, file) in expected {
            if !tensors.contains_key(&name) {
                return Err(Error::Tensor {
                    path: dir.join(&file),
                    name,
                    msg: "listed in model.safetensors.index.json but not present in the file".into(),
                });
            }
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), shards, tensors })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.values().map(|e| (e.end - e.start) as u64).sum()
    }

    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        match self.tensors.get(name) {
            Some(entry) => Ok(TensorRef { ckpt: self, name: name.to_string(), entry: entry.clone() }),
            None => Err(Error::MissingTensor { dir: self.dir.clone(), name: name.to_string() }),
        }
    }
}

fn parse_header(path: &Path, map: &[u8], shard: usize) -> Result<Vec<(String, Entry)>> {
    let bad = |msg: String| Error::Safetensors { path: path.to_path_buf(), msg };
    if map.len() < 8 {
        return Err(bad(format!("file is {} bytes, too short for a header", map.len())));
    }
    let n = u64::from_le_bytes(map[..8].try_into().unwrap()) as usize;
    if n > map.len() - 8 {
        return Err(bad(format!("header claims {n} bytes but the file has {} (truncated?)", map.len())));
    }
    let header: Value = serde_json::from_slice(&map[8..8 + n]).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let Value::Object(header) = header else {
        return Err(bad("header is not a JSON object".into()));
    };
    let data_start = 8 + n;
    let data_len = map.len() - data_start;
    let mut out = Vec::with_capacity(header.len());
    for (name, v) in header {
        if name == "__metadata__" {
            continue;
        }
        let tbad = |msg: String| Error::Tensor { path: path.to_path_buf(), name: name.clone(), msg };
        let dtype_s = v.get("dtype").and_then(Value::as_str).ok_or_else(|| tbad("header entry has no dtype".into()))?;
        let dtype = Dtype::parse(dtype_s).ok_or_else(|| tbad(format!("unsupported dtype {dtype_s}")))?;
        let shape: Vec<usize> = v
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| tbad("header entry has no shape".into()))?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| tbad("shape is not a list of sizes".into()))?;
        let offs = v
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()? as usize, a[1].as_u64()? as usize)))
            .ok_or_else(|| tbad("header entry has no valid data_offsets".into()))?;
        let (a, b) = offs;
        // Checked: a shape whose size overflows would otherwise wrap to a small byte count.
        let want = shape
            .iter()
            .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
            .ok_or_else(|| tbad(format!("shape {shape:?} of {dtype} is larger than any file (corrupt header)")))?;
        if b < a || b - a != want {
            return Err(tbad(format!("{} bytes of data for shape {shape:?} {dtype}, which needs {want} (corrupt header)", b.saturating_sub(a))));
        }
        if b > data_len {
            return Err(tbad(format!(
                "data ends at byte {} but the file has only {} (truncated file)",
                data_start + b,
                map.len()
            )));
        }
        out.push((name, Entry { shard, dtype, shape, start: data_start + a, end: data_start + b }));
    }
    Ok(out)
}

/// One tensor of a checkpoint, not yet copied anywhere.
pub struct TensorRef<'a> {
    ckpt: &'a Checkpoint,
    name: String,
    entry: Entry,
}

impl TensorRef<'_> {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn shape(&self) -> &[usize] {
        &self.entry.shape
    }
    pub fn dtype(&self) -> Dtype {
        self.entry.dtype
    }
    pub fn path(&self) -> &Path {
        &self.ckpt.shards[self.entry.shard].path
    }
    pub fn bytes(&self) -> &[u8] {
        &self.ckpt.shards[self.entry.shard].map[self.entry.start..self.entry.end]
    }
    pub fn numel(&self) -> usize {
        self.entry.shape.iter().product()
    }

    /// Fails unless the shape is exactly `want`.
    pub fn expect_shape(&self, want: &[usize]) -> Result<&Self> {
        if self.shape() != want {
            return Err(Error::TensorShape {
                path: self.path().to_path_buf(),
                name: self.name.clone(),
                expected: format!("{want:?}"),
                found: self.shape().to_vec(),
            });
        }
        Ok(self)
    }

    pub fn dtype_error(&self, expected: &str) -> Error {
        Error::TensorDtype {
            path: self.path().to_path_buf(),
            name: self.name.clone(),
            expected: expected.into(),
            found: self.dtype().to_string(),
        }
    }

    /// The values as f32, from F32, BF16 or F16.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = self.bytes();
        Ok(match self.dtype() {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
            Dtype::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            _ => return Err(self.dtype_error("F32, BF16 or F16")),
        })
    }

    /// The values as bf16 (BF16 as is; F32 and F16 rounded to nearest even, as a cast does).
    pub fn to_bf16(&self) -> Result<Vec<bf16>> {
        let b = self.bytes();
        Ok(match self.dtype() {
            Dtype::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect(),
            Dtype::F32 | Dtype::F16 => self.to_f32()?.into_iter().map(bf16::from_f32).collect(),
            _ => return Err(self.dtype_error("BF16, F32 or F16")),
        })
    }

    /// The packed words of a quantised weight, borrowed from the memory map when aligned.
    pub fn u32_buf(&self) -> Result<Buf<u32>> {
        if self.dtype() != Dtype::U32 {
            return Err(self.dtype_error("U32"));
        }
        Ok(Buf::from_map(&self.ckpt.shards[self.entry.shard].map, self.entry.start, self.entry.end - self.entry.start))
    }
}

impl TensorRef<'_> {
    /// A float tensor in its stored dtype, borrowed from the memory map when aligned.
    pub fn float_buf(&self) -> Result<crate::buf::FloatBuf> {
        use crate::buf::FloatBuf;
        let map = &self.ckpt.shards[self.entry.shard].map;
        let (s, n) = (self.entry.start, self.entry.end - self.entry.start);
        Ok(match self.dtype() {
            Dtype::BF16 => FloatBuf::Bf16(Buf::from_map(map, s, n)),
            Dtype::F16 => FloatBuf::F16(Buf::from_map(map, s, n)),
            Dtype::F32 => FloatBuf::F32(Buf::from_map(map, s, n)),
            _ => return Err(self.dtype_error("BF16, F16 or F32")),
        })
    }
}
