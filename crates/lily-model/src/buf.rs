//! `Buf<T>`: a read-only slice of plain values that is either borrowed from a memory-mapped
//! checkpoint (zero copy) or owned. Packed 4-bit weights of a 19 GB checkpoint stay in the page
//! cache this way; small or converted tensors are owned.

use std::ops::Deref;
use std::sync::Arc;

use memmap2::Mmap;

#[derive(Clone)]
enum Store<T: bytemuck::Pod> {
    Mapped { map: Arc<Mmap>, start: usize, len: usize },
    Owned(Arc<Vec<T>>),
}

/// A shared, immutable `[T]`; cloning is cheap.
#[derive(Clone)]
pub struct Buf<T: bytemuck::Pod> {
    store: Store<T>,
}

impl<T: bytemuck::Pod> Buf<T> {
    pub fn owned(v: Vec<T>) -> Self {
        Buf { store: Store::Owned(Arc::new(v)) }
    }

    /// Borrows `bytes` of `map` as `[T]` when they are aligned for `T`, else copies them.
    pub fn from_map(map: &Arc<Mmap>, start: usize, nbytes: usize) -> Self {
        let size = std::mem::size_of::<T>();
        debug_assert_eq!(nbytes % size, 0);
        let bytes = &map[start..start + nbytes];
        if bytemuck::try_cast_slice::<u8, T>(bytes).is_ok() {
            Buf { store: Store::Mapped { map: Arc::clone(map), start, len: nbytes / size } }
        } else {
            Buf::owned(bytemuck::pod_collect_to_vec(bytes))
        }
    }
}

impl<T: bytemuck::Pod> Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.store {
            Store::Mapped { map, start, len } => {
                let size = std::mem::size_of::<T>();
                bytemuck::cast_slice(&map[*start..*start + *len * size])
            }
            Store::Owned(v) => v,
        }
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for Buf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buf[{}]", self.len())
    }
}

/// Floating-point values in the dtype the checkpoint stored them in (scales, biases, dense
/// weights), read as f32 on demand.
#[derive(Clone, Debug)]
pub enum FloatBuf {
    Bf16(Buf<half::bf16>),
    F16(Buf<half::f16>),
    F32(Buf<f32>),
}

impl FloatBuf {
    pub fn len(&self) -> usize {
        match self {
            FloatBuf::Bf16(b) => b.len(),
            FloatBuf::F16(b) => b.len(),
            FloatBuf::F32(b) => b.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            FloatBuf::Bf16(b) => b[i].to_f32(),
            FloatBuf::F16(b) => b[i].to_f32(),
            FloatBuf::F32(b) => b[i],
        }
    }
    /// Converts `self[start..start + out.len()]` into `out`.
    pub fn read_into(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            FloatBuf::Bf16(b) => out.iter_mut().zip(&b[start..start + n]).for_each(|(o, v)| *o = v.to_f32()),
            FloatBuf::F16(b) => out.iter_mut().zip(&b[start..start + n]).for_each(|(o, v)| *o = v.to_f32()),
            FloatBuf::F32(b) => out.copy_from_slice(&b[start..start + n]),
        }
    }
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.len()];
        self.read_into(0, &mut v);
        v
    }
    pub fn dtype_name(&self) -> &'static str {
        match self {
            FloatBuf::Bf16(_) => "BF16",
            FloatBuf::F16(_) => "F16",
            FloatBuf::F32(_) => "F32",
        }
    }
}
