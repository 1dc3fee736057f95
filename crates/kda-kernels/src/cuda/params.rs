//! The kernel parameter block, passed by value to `kda_step`, `kda_eager` and `kda_ring`. Must
//! match `struct KdaParams` in `kernels/kda_decode.cu` field for field.

/// Operation codes of `kda_step` (`KDA_OP_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum OpCode {
    Decode = 0,
    Spec = 1,
    Replay = 2,
    /// `kda_step` only: the pending entries folded, then every token, stored once.
    Prefill = 3,
}

/// Error flags the kernel records in the error word (`KDA_ERR_*`).
pub(crate) const ERR_ACCEPTED: u32 = 1;
pub(crate) const ERR_DECODE_DRAFTS: u32 = 2;
pub(crate) const ERR_META: u32 = 4;
/// "No slot recorded" in the error word.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// `KdaParams::early` of a dependent launch (`EARLY_*` of `kda_decode.cu`): the tile kernels
/// read the slot again after the wait (`EARLY_PREFETCH`) or load the tile from the slot read
/// for the prefetch (`EARLY_SLOT_ONCE`).
pub(crate) const EARLY_PREFETCH: u32 = 1;
pub(crate) const EARLY_SLOT_ONCE: u32 = 2;

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
    pub delta: u64,
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
    /// Nonzero for a programmatic dependent launch: the eager and ring kernels prefetch their
    /// first items' state tiles (`kda_ring_tile` also its item's ring rows) into L2 before
    /// `griddepcontrol.wait` (0 otherwise): `EARLY_PREFETCH` or `EARLY_SLOT_ONCE`.
    pub early: u32,
    /// `kda_ring`: bytes per asynchronous copy of a token row (4, 8 or 16).
    pub ring_gran: u32,
    /// `kda_ring`: most new tokens of one sequence.
    pub ring_mq: u32,
    /// Division by the CTA units (or items) per sequence, `units * vblocks`.
    pub div_seq: FastDiv,
    /// Division by `vblocks`.
    pub div_vb: FastDiv,
    /// Division by the GVA group, `hv / h`.
    pub div_grp: FastDiv,
    /// `u32 [2]`: the count of the sequences computed, the first ones, and the batch's
    /// updates so far (0: all `n_seqs`, the layer's epoch): a padded batch's
    /// (`CudaBackend::prepare_padded`; read only by the padded modules, `KDA_PADDED`). Last,
    /// so that the other fields keep their offsets.
    pub live: u64,
}

const _: () = assert!(std::mem::size_of::<KdaParams>() == 17 * 8 + 30 * 4);

/// Division of a `u32` by a divisor fixed for a launch as a multiply-high, an add and a shift
/// (`struct KdaDiv` and `kda_div` in `kernels/kda_decode.cu`): for `d >= 1`, `s = ceil(log2
/// d)` and `m = floor(2^32 (2^s - d) / d) + 1`, `n / d = (mulhi(n, m) + n) >> s` for every
/// `u32` n, the sum taken in 64 bits (Granlund and Montgomery, 1994).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct FastDiv {
    /// The multiplier `m`.
    pub m: u32,
    /// The shift `s`.
    pub s: u32,
}

impl FastDiv {
    /// The constants for divisor `d` (`d == 0` is treated as 1: no kernel divides by 0).
    pub fn new(d: u32) -> Self {
        let d = u64::from(d.max(1));
        let s = 64 - (d - 1).leading_zeros();
        let m = ((1u64 << 32) * ((1u64 << s) - d) / d + 1) as u32;
        Self { m, s }
    }

    /// `n / d` the way the kernels compute it.
    #[cfg(test)]
    pub fn div(self, n: u32) -> u32 {
        let hi = (u64::from(n) * u64::from(self.m)) >> 32;
        ((hi + u64::from(n)) >> self.s) as u32
    }
}

// SAFETY: KdaParams is a plain `repr(C)` struct of u64/u32/f32 fields with no padding (checked
// above), laid out exactly like the kernel's `struct KdaParams`; it is passed by value.
unsafe impl cudarc::driver::DeviceRepr for KdaParams {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the integer constant `name` in the kernel source `src` (`#define NAME 3u`
    /// or `constexpr kda_u32 NAME = 3u;`).
    fn kernel_constant(src: &str, name: &str) -> u32 {
        let line = src
            .lines()
            .find(|l| {
                let l = l.trim_start();
                l.starts_with(&format!("#define {name} "))
                    || (l.starts_with("constexpr") && l.contains(&format!(" {name} = ")))
            })
            .unwrap_or_else(|| panic!("{name} is not defined in the kernel source"));
        let value = line
            .split(['=', ' ', ';'])
            .filter(|t| !t.is_empty())
            .skip_while(|t| *t != name)
            .nth(1)
            .unwrap_or_else(|| panic!("no value in {line:?}"));
        let digits = value.trim_end_matches(['u', 'U']);
        match digits.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => digits.parse(),
        }
        .unwrap_or_else(|e| panic!("{name}: {value:?} is not a number ({e})"))
    }

    #[test]
    fn op_codes_error_flags_and_the_slot_once_mode_are_the_kernels_constants() {
        let src = include_str!("../../../../kernels/kda_decode.cu");
        for (name, value) in [
            ("KDA_OP_DECODE", OpCode::Decode as u32),
            ("KDA_OP_SPEC", OpCode::Spec as u32),
            ("KDA_OP_REPLAY", OpCode::Replay as u32),
            ("KDA_OP_PREFILL", OpCode::Prefill as u32),
            ("KDA_ERR_ACCEPTED", ERR_ACCEPTED),
            ("KDA_ERR_DECODE_DRAFTS", ERR_DECODE_DRAFTS),
            ("KDA_ERR_META", ERR_META),
            ("KDA_NONE", NO_SLOT),
            ("EARLY_SLOT_ONCE", EARLY_SLOT_ONCE),
        ] {
            assert_eq!(kernel_constant(src, name), value, "{name}");
        }
    }

    #[test]
    fn fast_division_equals_integer_division() {
        let mut x = 0x9e37_79b9u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        let random: Vec<u32> = (0..2000).map(|_| next()).collect();
        let divisors = (1..=4096u32)
            .chain([
                65_535,
                65_536,
                65_537,
                1 << 31,
                (1 << 31) + 1,
                u32::MAX - 1,
                u32::MAX,
            ])
            .chain(random)
            .filter(|&d| d > 0);
        for d in divisors {
            let f = FastDiv::new(d);
            let edges = [
                0,
                1,
                d - 1,
                d,
                d.wrapping_add(1),
                u32::MAX,
                u32::MAX - 1,
                u32::MAX / d * d,
            ];
            for n in edges.into_iter().chain((0..200).map(|_| next())) {
                assert_eq!(f.div(n), n / d, "{n} / {d}");
            }
        }
    }
}

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
