//! The whole forward pass on the CPU, in the order of the architecture spec
//! (`qwen36-architecture.md` §2):
//!
//! ```text
//! x = embed(ids)                                         [T, H]
//! for each layer l:
//!     x = x + Mixer_l(RMSNorm(x, input_norm))            GDN (linear) or gated attention (full)
//!     x = x + MoE_l(RMSNorm(x, post_norm))
//! logits = RMSNorm(x, final_norm) · lm_headᵀ             [T, V]
//! ```
//!
//! A [`State`] holds everything a sequence has left behind (conv and recurrent states of the GDN
//! layers, KV caches of the attention layers); it can be cloned, saved and resumed, so a prompt can be
//! processed in chunks and continued later.

use std::io::{Read, Write};
use std::sync::Arc;

use lily_model::weights::{GdnWeights, Mixer, Mlp};
use lily_model::{Backend, BackendError, LayerKind, Logits, ModelConfig, ModelWeights};

use crate::attention::{self, KvCache};
use crate::gdn::{self, GdnDims};
use crate::linear::{embed_row, matmul, matmul_buf};
use crate::moe;
use crate::norm::rms_norm;
use crate::workspace::Buf;

/// GDN chunks of at least this many tokens use the chunked delta rule; shorter ones step.
const CHUNKED_MIN_TOKENS: usize = 16;

/// What one layer remembers about the sequence.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// conv: [K-1, C] raw projections; ssm: [Hv, Dk, Dv] f32 recurrent state.
    Linear { conv: Vec<f32>, ssm: Vec<f32> },
    Full(KvCache),
}

/// A sequence's state after `pos` tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct State {
    pub pos: usize,
    pub layers: Vec<LayerState>,
}

/// Hidden states recorded by [`CpuModel::forward_traced`]: the residual stream after each layer
/// (`[T, H]` each) and after the final norm.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub layers: Vec<Vec<f32>>,
    pub final_norm: Vec<f32>,
}

/// The model on the CPU.
#[derive(Clone)]
pub struct CpuModel {
    w: Arc<ModelWeights>,
    /// Round the KV cache to bf16 as it is appended (the CUDA backend's storage; for its tests).
    kv_bf16: bool,
}

impl CpuModel {
    pub fn new(w: Arc<ModelWeights>) -> Self {
        CpuModel { w, kv_bf16: false }
    }
    /// This model with its KV cache stored as bf16 (rounded to nearest even), as the CUDA backend
    /// stores it: the reference the GPU's whole-model tests compare against.
    pub fn with_bf16_kv(mut self, on: bool) -> Self {
        self.kv_bf16 = on;
        self
    }
    pub fn weights(&self) -> &ModelWeights {
        &self.w
    }
    fn gdn_dims(cfg: &ModelConfig) -> GdnDims {
        GdnDims::from_config(cfg)
    }

    pub fn fresh_state(&self) -> State {
        let cfg = &self.w.config;
        let d = Self::gdn_dims(cfg);
        let layers = cfg
            .layer_types
            .iter()
            .map(|k| match k {
                LayerKind::LinearAttention => LayerState::Linear { conv: vec![0.0; d.conv_state_len()], ssm: vec![0.0; d.state_len()] },
                LayerKind::FullAttention => LayerState::Full(KvCache::default()),
            })
            .collect();
        State { pos: 0, layers }
    }

    /// Runs `tokens` after `state`; returns the logits asked for and, if `trace`, the hidden states.
    pub fn forward_traced(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: Logits,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, BackendError> {
        // One hand-off to the thread pool per call: the parallel loops inside then start on a worker,
        // where a loop too small to split runs in place. From outside the pool every one of them
        // would wake a worker and wait for it (two context switches per loop, dozens per token).
        rayon::scope(|_| self.forward_in_pool(state, tokens, want, trace))
    }

    fn forward_in_pool(
        &self,
        state: &mut State,
        tokens: &[u32],
        want: Logits,
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, BackendError> {
        let cfg = &self.w.config;
        let h = cfg.hidden_size;
        let t = tokens.len();
        if state.layers.len() != cfg.num_hidden_layers {
            return Err(BackendError::BadState(format!("{} layers, model has {}", state.layers.len(), cfg.num_hidden_layers)));
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= cfg.vocab_size) {
            return Err(BackendError::InvalidToken { id, vocab: cfg.vocab_size });
        }
        if t == 0 {
            return Ok(Vec::new());
        }

        // x = embed(ids): [T, H]
        let mut x = Buf::for_output(t * h);
        for (row, &id) in x.chunks_exact_mut(h).zip(tokens) {
            embed_row(&self.w.embed, id as usize, row);
        }
        let mut normed = Buf::for_output(t * h);
        for (l, layer) in self.w.layers.iter().enumerate() {
            rms_norm(&x, &layer.input_norm, cfg.rms_norm_eps, &mut normed);
            let mixed = match (&layer.mixer, &mut state.layers[l]) {
                (Mixer::Linear(w), LayerState::Linear { conv, ssm }) => gdn_layer(w, cfg, &normed, conv, ssm),
                (Mixer::Full(w), LayerState::Full(cache)) => attention::forward(w, cfg, &normed, cache, self.kv_bf16),
                _ => return Err(BackendError::BadState(format!("layer {l} kind does not match"))),
            };
            x.iter_mut().zip(mixed.iter()).for_each(|(a, b)| *a += b);

            rms_norm(&x, &layer.post_norm, cfg.rms_norm_eps, &mut normed);
            let mlp = match &layer.mlp {
                Mlp::Moe(w) => moe::forward(w, cfg, &normed),
                Mlp::Dense(w) => moe::dense_mlp(w, &normed),
            };
            x.iter_mut().zip(mlp.iter()).for_each(|(a, b)| *a += b);
            if let Some(tr) = trace.as_deref_mut() {
                tr.layers.push(x.to_vec());
            }
        }
        state.pos += t;

        rms_norm(&x, &self.w.final_norm, cfg.rms_norm_eps, &mut normed);
        if let Some(tr) = trace {
            tr.final_norm = normed.to_vec();
        }
        let rows: &[f32] = match want {
            Logits::None => return Ok(Vec::new()),
            Logits::Last => &normed[(t - 1) * h..],
            Logits::All => &normed,
        };
        let mut logits = vec![0.0f32; rows.len() / h * cfg.vocab_size];
        matmul(self.w.lm_head(), 0, rows, &mut logits);
        Ok(logits)
    }
}

/// One Gated DeltaNet mixer on normed input x [T, H]; advances the conv and recurrent states.
fn gdn_layer(w: &GdnWeights, cfg: &ModelConfig, x: &[f32], conv: &mut [f32], ssm: &mut [f32]) -> Buf {
    let d = CpuModel::gdn_dims(cfg);
    let t = x.len() / cfg.hidden_size;
    let mixed = matmul_buf(&w.in_proj_qkv, 0, x); // [T, C] = q | k | v
    let z = matmul_buf(&w.in_proj_z, 0, x); // [T, Hv·Dv]
    let b = matmul_buf(&w.in_proj_b, 0, x); // [T, Hv]
    let a = matmul_buf(&w.in_proj_a, 0, x); // [T, Hv]

    // Each of these is written whole by the function that fills it.
    let mut qkv = Buf::for_output(mixed.len());
    gdn::causal_conv1d_silu(&mixed, &w.conv1d, conv, &d, &mut qkv);
    gdn::normalize_qk(&mut qkv, &d);
    let (mut g, mut beta) = (Buf::for_output(t * d.num_v_heads), Buf::for_output(t * d.num_v_heads));
    gdn::gates(&a, &b, &w.a_log, &w.dt_bias, &mut g, &mut beta);

    let mut o = Buf::for_output(t * d.value_dim()); // [T, Hv, Dv]
    if t >= CHUNKED_MIN_TOKENS {
        gdn::delta_rule_chunked(&qkv, &g, &beta, ssm, &d, &mut o);
    } else {
        gdn::delta_rule_recurrent(&qkv, &g, &beta, ssm, &d, &mut o);
    }
    let mut y = Buf::for_output(t * d.value_dim());
    gdn::gated_rmsnorm(&o, &z, &w.norm, cfg.rms_norm_eps, &d, &mut y);
    matmul_buf(&w.out_proj, 0, &y) // [T, H]
}

impl Backend for CpuModel {
    type State = State;

    fn name(&self) -> &'static str {
        "cpu"
    }
    fn config(&self) -> &ModelConfig {
        &self.w.config
    }
    fn new_state(&self) -> State {
        self.fresh_state()
    }
    fn state_len(&self, state: &State) -> usize {
        state.pos
    }
    fn state_bytes(&self, state: &State) -> usize {
        state.bytes()
    }
    fn forward(&mut self, state: &mut State, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, BackendError> {
        self.forward_traced(state, tokens, logits, None)
    }
    fn reserve(&mut self, state: &mut State, positions: usize) -> Result<(), BackendError> {
        let row = self.w.config.num_key_value_heads * self.w.config.head_dim;
        for l in &mut state.layers {
            if let LayerState::Full(kv) = l {
                for buf in [&mut kv.k, &mut kv.v] {
                    buf.reserve((positions * row).saturating_sub(buf.len()));
                }
            }
        }
        Ok(())
    }
}

const MAGIC: &[u8; 8] = b"LILYST01";

impl State {
    /// Memory held, in bytes (the KV caches' reserved room included).
    pub fn bytes(&self) -> usize {
        let floats: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Linear { conv, ssm } => conv.len() + ssm.len(),
                LayerState::Full(c) => c.k.capacity() + c.v.capacity(),
            })
            .sum();
        floats * 4
    }

    /// Writes the state in a small self-describing binary form (little-endian).
    pub fn save(&self, mut out: impl Write) -> std::io::Result<()> {
        out.write_all(MAGIC)?;
        out.write_all(&(self.pos as u64).to_le_bytes())?;
        out.write_all(&(self.layers.len() as u64).to_le_bytes())?;
        let put = |out: &mut dyn Write, v: &[f32]| -> std::io::Result<()> {
            out.write_all(&(v.len() as u64).to_le_bytes())?;
            for x in v {
                out.write_all(&x.to_le_bytes())?;
            }
            Ok(())
        };
        for l in &self.layers {
            match l {
                LayerState::Linear { conv, ssm } => {
                    out.write_all(&[0])?;
                    put(&mut out, conv)?;
                    put(&mut out, ssm)?;
                }
                LayerState::Full(c) => {
                    out.write_all(&[1])?;
                    put(&mut out, &c.k)?;
                    put(&mut out, &c.v)?;
                }
            }
        }
        Ok(())
    }

    /// Reads what [`State::save`] wrote.
    pub fn load(mut inp: impl Read) -> std::io::Result<State> {
        let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
        let mut magic = [0u8; 8];
        inp.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(bad("not a lily CPU state"));
        }
        let mut u = [0u8; 8];
        let mut get_u64 = |inp: &mut dyn Read| -> std::io::Result<u64> {
            inp.read_exact(&mut u)?;
            Ok(u64::from_le_bytes(u))
        };
        let pos = get_u64(&mut inp)? as usize;
        let n = get_u64(&mut inp)? as usize;
        let get_vec = |inp: &mut dyn Read| -> std::io::Result<Vec<f32>> {
            let mut b8 = [0u8; 8];
            inp.read_exact(&mut b8)?;
            let len = u64::from_le_bytes(b8) as usize;
            let mut bytes = vec![0u8; len.checked_mul(4).ok_or_else(|| bad("length overflow"))?];
            inp.read_exact(&mut bytes)?;
            Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
        };
        let mut layers = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let mut tag = [0u8; 1];
            inp.read_exact(&mut tag)?;
            let (a, b) = (get_vec(&mut inp)?, get_vec(&mut inp)?);
            layers.push(match tag[0] {
                0 => LayerState::Linear { conv: a, ssm: b },
                1 => LayerState::Full(KvCache { k: a, v: b }),
                _ => return Err(bad("unknown layer tag")),
            });
        }
        Ok(State { pos, layers })
    }
}
