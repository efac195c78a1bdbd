//! Reused f32 buffers for the activations of a forward call. A 512-token prefill chunk of the demo
//! model needs about 150 MB of intermediates, a few MB each; fresh allocations of that size are
//! mapped and unmapped by the allocator on every call, and the page faults and zeroing cost 5–8% of
//! a prefill. A [`Buf`] comes from a small per-thread pool and goes back to it when dropped, so a
//! steady stream of calls of one shape allocates nothing after the first.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

/// Buffers smaller than this are left to the allocator (it keeps those itself).
const MIN_POOLED: usize = 16 << 10;
/// At most this many buffers, and this many f32 in all, wait in one thread's pool.
const MAX_POOLED: usize = 64;
const MAX_POOLED_FLOATS: usize = 128 << 20;

thread_local! {
    static POOL: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// An f32 buffer from the calling thread's pool, returned to the pool of the thread that drops it.
#[derive(Debug, Default)]
pub struct Buf(Vec<f32>);

impl Buf {
    /// `len` zeros.
    pub fn zeros(len: usize) -> Buf {
        let mut b = Buf::for_output(len);
        b.0.fill(0.0);
        b
    }

    /// `len` values left over from earlier use, for an output the caller writes whole.
    pub fn for_output(len: usize) -> Buf {
        if len < MIN_POOLED {
            return Buf(vec![0.0; len]);
        }
        // The smallest pooled buffer that is large enough.
        let taken = POOL.with(|p| {
            let mut p = p.borrow_mut();
            let best = (0..p.len()).filter(|&i| p[i].capacity() >= len).min_by_key(|&i| p[i].capacity());
            best.map(|i| p.swap_remove(i))
        });
        // A new buffer gets a power-of-two capacity: sizes that grow a little with every call (the
        // attention scores, one position per decoded token) then keep reusing it.
        let mut v = taken.unwrap_or_else(|| Vec::with_capacity(len.next_power_of_two()));
        v.resize(len, 0.0);
        v.truncate(len);
        Buf(v)
    }

    /// A copy of `src`.
    pub fn copy_of(src: &[f32]) -> Buf {
        let mut b = Buf::for_output(src.len());
        b.copy_from_slice(src);
        b
    }

    /// The values as a plain vector (leaves the pool's economy).
    pub fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(&mut self.0)
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() < MIN_POOLED {
            return;
        }
        // A thread that is being torn down has no pool any more: the buffer is simply freed.
        let _ = POOL.try_with(|p| {
            let mut p = p.borrow_mut();
            let held: usize = p.iter().map(|b| b.capacity()).sum();
            if p.len() < MAX_POOLED && held + v.capacity() <= MAX_POOLED_FLOATS {
                p.push(v);
            }
        });
    }
}

impl Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_zeroed_when_asked() {
        let n = 1 << 20;
        let mut a = Buf::zeros(n);
        a.iter_mut().for_each(|v| *v = 7.0);
        let ptr = a.as_ptr();
        drop(a);
        // The same buffer comes back, its old values still there for an output...
        let b = Buf::for_output(n / 2);
        assert_eq!(b.as_ptr(), ptr);
        assert_eq!(b.len(), n / 2);
        assert!(b.iter().all(|&v| v == 7.0));
        drop(b);
        // ...and cleared for zeros.
        let c = Buf::zeros(n);
        assert_eq!(c.as_ptr(), ptr);
        assert!(c.iter().all(|&v| v == 0.0));
        // A larger request than anything pooled gets a new buffer, with room to grow into.
        let d = Buf::zeros(2 * n + 1);
        assert_eq!(d.len(), 2 * n + 1);
        assert_ne!(d.as_ptr(), ptr);
        let dptr = d.as_ptr();
        drop(d);
        assert_eq!(Buf::for_output(2 * n + 100).as_ptr(), dptr);
        assert_eq!(Buf::copy_of(&[1.0, 2.0]).into_vec(), vec![1.0, 2.0]);
    }
}
