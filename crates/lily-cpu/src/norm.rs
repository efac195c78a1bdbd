//! RMSNorm with a folded weight: `y = x · rsqrt(mean(x²) + eps) · w`, in f32, per row.
//! The checkpoint loader has already turned Qwen's zero-centred `w` into `1 + w`.

/// x, y: [rows, n]; w: [n].
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let n = w.len();
    for (xr, yr) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), wi) in yr.iter_mut().zip(xr).zip(w) {
            *o = v * inv * wi;
        }
    }
}

/// In place, per row of `w.len()`.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for xr in x.chunks_exact_mut(n) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, wi) in xr.iter_mut().zip(w) {
            *v = *v * inv * wi;
        }
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}
