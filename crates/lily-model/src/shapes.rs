//! Sizes derived from the config that more than one backend needs, in one place.

use crate::config::ModelConfig;

/// The sizes of one Gated DeltaNet layer. Value head `j` reads key head `j / (Hv/Hk)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnDims {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub head_k_dim: usize,
    pub head_v_dim: usize,
    pub conv_kernel: usize,
}

impl GdnDims {
    /// The GDN sizes of a model config (`linear_*`).
    pub fn from_config(cfg: &ModelConfig) -> Self {
        GdnDims {
            num_k_heads: cfg.linear_num_key_heads,
            num_v_heads: cfg.linear_num_value_heads,
            head_k_dim: cfg.linear_key_head_dim,
            head_v_dim: cfg.linear_value_head_dim,
            conv_kernel: cfg.linear_conv_kernel_dim,
        }
    }
    /// Conv channels C = 2·key_dim + value_dim (q | k | v).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Hk·Dk: the width of the q block and of the k block.
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.head_k_dim
    }
    /// Hv·Dv: the width of the v block, of z and of the rule's output.
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.head_v_dim
    }
    /// Hv·Dk·Dv: the f32 recurrent state.
    pub fn state_len(&self) -> usize {
        self.num_v_heads * self.head_k_dim * self.head_v_dim
    }
    /// (K-1)·C: the conv state (the last K-1 raw input rows).
    pub fn conv_state_len(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.conv_dim()
    }
    /// The key (and query) head that value head `j` reads: j / (Hv/Hk) (`repeat_interleave`).
    pub fn key_head_of(&self, j: usize) -> usize {
        j / (self.num_v_heads / self.num_k_heads)
    }
    /// Non-empty, and Hv a multiple of Hk.
    pub fn is_valid(&self) -> bool {
        self.num_k_heads > 0
            && self.num_v_heads.is_multiple_of(self.num_k_heads)
            && self.head_k_dim > 0
            && self.head_v_dim > 0
            && self.conv_kernel > 0
    }
}
