//! Kernel choices a caller can force on the CUDA backend (benchmarks, tests). By default the
//! backend picks per call from the call's shape.

/// The eager-decode kernels (`ring_len` 0, one token per sequence).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EagerKernel {
    /// Persistent CTAs that copy the next items' state tiles into shared memory while they
    /// compute the current one (`kda_eager`, `kda_eager_stage`), where the shape allows it.
    Pipelined,
    /// One item per CTA, its state tile straight into registers and its token's inputs loaded
    /// first (`kda_eager_tile`), where the shape allows the pipelined kernel.
    Tile,
    /// `kda_eager_tile_staged`: the tile kernel with its state tile copied in through shared
    /// memory in whole 16-byte chunks (so a warp fetches whole tile rows), written back from
    /// registers; same bits.
    StagedTile,
    /// `kda_eager_tile_bulk`: the tile kernel with its state tile moved in and out by bulk
    /// copies (`cp.async.bulk`, sm_90 and later) through shared memory, one instruction per
    /// contiguous block instead of per-lane loads and stores; same bits. (Forced on an older
    /// GPU, plain copies by the issuing lanes stand in: same bits, slow.)
    BulkTile,
    /// `kda_eager_tile_bulk_in`: `BulkTile` with its updated tile stored from registers, as
    /// `Tile` does; same bits.
    BulkInTile,
    /// `kda_eager_tile_stream`: `BulkTile` with its token step streamed from the tile in shared
    /// memory (read twice, written back in place) instead of held in registers, so more CTAs
    /// share an SM; same bits.
    StreamTile,
    /// `kda_eager_regs`: one whole head per CTA of 8 warps in registers, warp j the 16 rows of
    /// lane group j, each warp access a whole row (so the warps' sums need no hand-off); same
    /// bits. K-first pools with K = V = 128 only; elsewhere `StreamTile` runs instead. The
    /// default for those pools on devices with bulk copies at 1536-8192 value heads (2-byte)
    /// and 768-8192 (fp32).
    RegsTile,
    /// `kda_eager_bulk_pipe`: persistent CTAs over whole heads, one warp loading the next
    /// heads' tiles and inputs by bulk copies into a ring of shared-memory buffers, three groups
    /// of eight warps taking the heads in turn with `StreamTile`'s token step, and one warp
    /// storing the stepped tiles by bulk copies; same bits. The default for 2-byte K-first
    /// calls of 384-2271 value heads (384-1535 where K = V = 128, then `RegsTile`) on devices
    /// with bulk copies. Where it does not fit (no bulk copies, heads wider than one CTA's
    /// columns, or too few buffers in shared memory) `StreamTile` runs instead.
    BulkPipe,
    /// The general kernel of every operation, one item per CTA (`kda_step`).
    Step,
}

/// The kernels of calls with a ring (decode, spec_verify and replay over the replay ring). All
/// but `Mma`, `Delta` and `DeltaStaged` give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingKernel {
    /// Persistent CTAs of 8 warps that copy the next item's token rows and state tile into
    /// shared memory while they compute the current one (`kda_ring`), where the call fits it.
    Pipelined,
    /// One item (sequence, value head, 8 warps' columns) per CTA, its state tile straight into
    /// registers (`kda_ring_tile`), where the call fits it.
    Tile,
    /// `kda_ring_mma`: `Tile`'s items with the item's tokens applied to the state tile as one
    /// chunk on the tensor cores (3xTF32 `mma.sync`, f32 accuracy), the tile read once into
    /// shared memory and written once at a commit. K = 128 and whole 128-column items only; not
    /// the bits of the others (fp32 states within about 1e-6, 2-byte ones within one rounding
    /// step of them). The default for big spec_verify calls of four or more drafts on 2-byte
    /// pools.
    Mma,
    /// `kda_ring_delta`: `Tile`'s items for every ring operation. It keeps each appended entry's
    /// f32 delta vector in the pool's delta plane, so a new token (decoded or a draft) needs two
    /// products with the state tile instead of a replay of the pending entries, and a commit is
    /// one rank-`pending` update. Pending entries another kernel appended are replayed once.
    /// Needs a pool with a delta plane (`PoolGeometry::ring_deltas`), where it is the default for
    /// ring decode and spec_verify. Not the bits of the others (fp32 states within about 1e-6,
    /// 2-byte ones within one rounding step of them).
    Delta,
    /// `kda_ring_delta_staged`: `Delta` for ring decode of 2-byte K-first pools with K = V =
    /// 128, its lean path reading the state tile from shared memory (each lane copies its own
    /// rows there) instead of holding it in registers, so three CTAs share an SM instead of
    /// two. Same bits as `Delta`. The default for such calls from 2048 items (value heads x
    /// column blocks) on pools with a delta plane; other calls forced to it run `Step`.
    DeltaStaged,
    /// The general kernel of every operation, one q/k head with its value heads per CTA
    /// (`kda_step`).
    Step,
}

/// The prefill kernels of the CUDA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillKernel {
    /// `kda_step`: every token of a sequence after the other, decode's token step (sequences
    /// of a few tokens; 32 x 256 tokens at 32 heads ran as fast as chunked on an H100).
    Steps,
    /// `kda_chunk_prep`, `kda_chunk_state` (or `kda_chunk_state_narrow`) and `kda_chunk_out`
    /// (spec section 3): chunks of 64 tokens prepared all at once, the state carried from
    /// chunk to chunk, then the outputs of all chunks at once. Plain batches of heads with
    /// `K % 16 == 0` and `V % 8 == 0` whose preparation fits shared memory (K = V = 128 does);
    /// other calls run `Steps`. Not the bits of `Steps` (fp32 states within about 1e-6,
    /// 2-byte ones within one rounding step of them).
    Chunked,
    /// `Chunked` where a cost model of the call's shape expects it faster than `Steps` (one
    /// sequence of 256 tokens or more ran 3-15x faster chunked on an H100, 8 of 4096 at 32
    /// heads 1.07x, 32 of 256 at 32 heads as fast either way; sequences of a few tokens stay
    /// on `Steps`), else `Steps`. The default.
    ByShape,
}
