//! The lane geometry of the kernels' token step (`kda_step` and every kernel built on it),
//! mirroring the constexprs `LK`, `RG` and `WC` of `kernels/kda_decode.cu`.

/// The lane geometry of `kda_step` for key dim `k` (mirrors the kernel's constexprs): lanes
/// along K (`LK`, a power of two).
pub(super) fn lanes_k(k: usize) -> usize {
    k.div_ceil(16).next_power_of_two().min(32)
}

/// The lane geometry of `kda_step` for key dim `k`: columns covered by one warp.
pub(super) fn warp_columns(k: usize) -> usize {
    (32 / lanes_k(k)) * 4
}

/// Whether the pipelined kernels (`kda_eager`, `kda_ring`) can copy a state tile of key dim
/// `k`, value dim `v` and `state_size`-byte elements, and its dt_bias row, in whole 16-byte
/// chunks into shared memory and read it back with `kda_step`'s lane mapping (LK, RG, WC of
/// `kernels/kda_decode.cu`).
pub(super) fn tile_fits(k: usize, v: usize, state_size: usize) -> bool {
    let lk = lanes_k(k);
    let sv = 16 / state_size;
    let rg = if k.is_multiple_of(sv) { sv } else { 1 };
    k.is_multiple_of(lk)
        && (k / lk).is_multiple_of(rg)
        && v.is_multiple_of(4)
        && [
            warp_columns(k) * state_size,
            v * state_size,
            k * state_size,
            k * 4,
        ]
        .iter()
        .all(|b| b.is_multiple_of(16))
}
