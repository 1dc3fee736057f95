//! The kernel parameter block, passed by value to `kda_step`, `kda_eager` and `kda_ring`. Must
//! match `struct KdaParams` in `kernels/kda_decode.cu` field for field.

/// Operation codes of `kda_step` (`KDA_OP_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum OpCode {
    Decode = 0,
    Spec = 1,
    Replay = 2,
}

/// Error flags the kernel records in the error word (`KDA_ERR_*`).
pub(crate) const ERR_ACCEPTED: u32 = 1;
pub(crate) const ERR_DECODE_DRAFTS: u32 = 2;
pub(crate) const ERR_META: u32 = 4;
/// "No slot recorded" in the error word.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// `struct KdaParams` of `kda_decode.cu`: device pointers (0 when absent) then 32-bit fields.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KdaParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub g: u64,
    pub beta: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub out: u64,
    pub ssm: u64,
    pub ring: u64,
    pub meta: u64,
    pub bounds: u64,
    pub slots: u64,
    pub accepted: u64,
    pub err: u64,
    pub n_seqs: u32,
    pub h: u32,
    pub hv: u32,
    pub ring_len: u32,
    pub op: u32,
    pub gate_mode: u32,
    pub beta_sigmoid: u32,
    pub l2norm: u32,
    pub scale: f32,
    pub lower_bound: f32,
    pub beta_factor: f32,
    pub sr: u32,
    pub seed_lo: u32,
    pub seed_hi: u32,
    pub layer: u32,
    pub epoch: u32,
    pub heads_per_cta: u32,
    pub units: u32,
    pub vblocks: u32,
    /// Pipeline stages of the eager kernel (2 or 3; ignored by `kda_step`).
    pub stages: u32,
    /// `kda_ring`: token rows per stage (ring length + most new tokens of a sequence).
    pub ring_mt: u32,
    /// Zero.
    pub ring_spare: u32,
    /// `kda_ring`: bytes per asynchronous copy of a token row (4, 8 or 16).
    pub ring_gran: u32,
    /// `kda_ring`: most new tokens of one sequence.
    pub ring_mq: u32,
}

const _: () = assert!(std::mem::size_of::<KdaParams>() == 15 * 8 + 24 * 4);

// SAFETY: KdaParams is a plain `repr(C)` struct of u64/u32/f32 fields with no padding (checked
// above), laid out exactly like the kernel's `struct KdaParams`; it is passed by value.
unsafe impl cudarc::driver::DeviceRepr for KdaParams {}

/// Parameters of the `kda_fill` kernel (`struct KdaFill` in `kernels/kda_fill.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FillParams {
    pub ptr: u64,
    pub len: u64,
    pub dtype: u32,
    pub seed: u32,
    pub scale: f32,
    pub pad: u32,
}

const _: () = assert!(std::mem::size_of::<FillParams>() == 32);

// SAFETY: plain `repr(C)` struct without padding, matching the kernel's `struct KdaFill`.
unsafe impl cudarc::driver::DeviceRepr for FillParams {}
