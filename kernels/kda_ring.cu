// Decode, spec_verify and replay over the replay ring, pipelined (kda_ring): the default kernel
// with a ring and nearest rounding where the shape fits (`ring_plan` in ring_plan.rs; kda_step
// otherwise). Compiled in the same module as
// kda_decode.cu, after it: the token step, the activations, the plan, the ring layout and the
// tile copies are shared, so it gives kda_step's bits (and, for fp32 pools, eager decode's).
//
// Work split. Items (sequence, value head, block of RCW = 8 WC columns: a whole head at
// K = V = 128) are looped over by persistent CTAs of RT = 256 threads (eight warps with
// kda_step's lane mapping). The next item's token rows (its pending ring entries and new tokens:
// k, g, v of its columns, q of the new tokens) and dt_bias are copied into the other of two
// stages with cp.async while the current item computes; its state tile goes into the one tile
// buffer as soon as the current tile is in registers, so the copy overlaps the token steps and
// an fp32 head (64 KB) still leaves room for two CTAs per SM. One thread, the bookkeeper (lane 0
// of the last warp, which activates a unit only when an item has eight), looks the items up
// ahead: the slot three items ahead, the ring record and the accepted count two ahead, the plan
// one ahead of the item whose copies are issued next. It does its work (and the arrival, below)
// right after the first barrier of an item, while its warp usually has nothing to activate, so
// no copy waits on a dependent load and the other warps do not wait for the bookkeeping (done by
// thread 0 after its token steps, it held every warp at the next barrier: ring decode was 4-11%
// slower). An item's activations run at once, one warp per unit (each token, then each new
// token's query), then each warp steps its columns through the tokens with no barrier in
// between. Stores round to nearest only (the stochastic store's registers would spill the
// token loop); the host runs kda_step for stochastic-rounding pools.
//
// Ring data. Without a commit an item appends its own part of the new tokens' entries (rows
// beyond the pending entries, which no item reads). A commit overwrites entries 0.., which the
// other items of the slot may still read, so the CTA that finishes the slot's last item (the
// `arrive` counter) copies the whole slot's new entries, and writes the new record, one item
// later (the atomic's result is not waited for in the item that issues it). An item arrives once
// its token rows are in shared memory, i.e. once it has read all it reads of the ring.
//
// Code size. The item loop waits on instruction fetch (ncu: 10% of stall samples), so the rare
// paths (the commit copy, the epilogue, the copies for each row granularity) are written once
// and not unrolled: 10k -> 5k SASS instructions made ring decode 1-4% faster for 2-byte pools
// and 3-4% for fp32 ones (docs/performance.md, tenth session); the row copies' loops not
// unrolled either (5k -> 4.2k), about 1% more at N = 256 (eleventh session).
#include "kda_decode.cu"

namespace kda {

constexpr int RT = 256;                          // threads of a kda_ring CTA
constexpr int RCW = (RT / 32) * WC;              // columns of an item
constexpr int MTC = 16;                          // most tokens of an item (host checks)
constexpr int RK = round16(K * (int)sizeof(IT)); // bytes of a raw K row in a stage
constexpr int RTILE = round16(K * RCW * (int)sizeof(ST)); // bytes of the tile buffer

// Byte offsets in dynamic shared memory (mirrored by `ring_plan` in ring_plan.rs): the tile buffer
// [0, RTILE), then two stages at RTILE + j stage. A stage: per token t at t tokb its raw k, g
// ([K] each) and v ([RCW]), the raw q of new token t at qrow + (t - pend) RK, then dt_bias (f32
// [K]). After the two stages, f32 arrays: ka, da [mt][KS] (activated keys, decays), qa [mq][KS] (queries of the new tokens),
// va [mt][RCW] (values), beta [MTC], raw beta [2][MTC] and a_log [2] (per stage).
struct RingLayout {
    int tokb, qrow, bias, stage, ka, da, qa, va, sbeta, braw, alog, bytes;
    __device__ __forceinline__ RingLayout(int mt, int mq) {
        tokb = 2 * RK + round16(RCW * (int)sizeof(IT));
        qrow = mt * tokb;
        bias = qrow + mq * RK;
        stage = bias + round16(K * 4);
        ka = RTILE + 2 * stage;
        da = ka + 4 * mt * KS;
        qa = da + 4 * mt * KS;
        va = qa + 4 * mq * KS;
        sbeta = va + 4 * mt * RCW;
        braw = sbeta + 4 * MTC;
        alog = braw + 4 * 2 * MTC;
        bytes = alog + 16;
    }
};

// One work item: sequence n (slot, first token, new tokens), value head, first column, plan.
struct RingItem {
    kda_u32 n, slot, bos, nnew;
    int hv, cb;
    Plan pl;
};

__device__ __forceinline__ kda_u32 ring_seq(const KdaParams& p, kda_u32 item) { return kda_div(item, p.div_seq); }

__device__ __forceinline__ void ring_coords(const KdaParams& p, kda_u32 item, RingItem& it) {
    it.n = ring_seq(p, item);
    const kda_u32 rem = item - it.n * (p.hv * p.vblocks);
    const kda_u32 hv = kda_div(rem, p.div_vb);
    it.hv = (int)hv;
    it.cb = (int)(rem - hv * p.vblocks) * RCW;
}

// What an item's plan needs of its sequence: the slot, the token bounds [b0, b1), the ring
// record (len, pending) and the accepted count.
struct RingRec {
    kda_u32 slot, b0, b1, len, pend, acc;
};

// The bookkeeper: issues the loads of item `item`'s record (its sequence's slot known); the
// values are waited for where the plan uses them.
__device__ __forceinline__ RingRec ring_rec_load(const KdaParams& p, kda_u32 item, kda_u32 slot) {
    const kda_u32 n = ring_seq(p, item);
    const kda_u32* bounds = reinterpret_cast<const kda_u32*>(p.bounds);
    const volatile kda_u32* vm = reinterpret_cast<const kda_u32*>(p.meta) + (size_t)slot * 4;
    RingRec r;
    r.slot = slot;
    r.b0 = bounds[n];
    r.b1 = bounds[n + 1];
    r.acc = p.accepted ? reinterpret_cast<const kda_u32*>(p.accepted)[n] : 0u;
    r.len = vm[0];
    r.pend = vm[1];
    return r;
}

// An item from its index and its sequence's record (the bookkeeper only: the plan may record
// errors).
__device__ __forceinline__ RingItem ring_item(const KdaParams& p, kda_u32 item, const RingRec& r) {
    RingItem it;
    ring_coords(p, item, it);
    it.slot = r.slot;
    it.bos = r.b0;
    it.nnew = r.b1 - r.b0;
    it.pl = plan_from(p, r.slot, it.nnew, r.len, r.pend, r.acc, reinterpret_cast<kda_u32*>(p.err),
                      it.hv == 0 && it.cb == 0);
    return it;
}

// The lanes of a warp copy `bytes` (a multiple of gran) from src to dst, gran bytes at a time.
__device__ __forceinline__ void copy_row(unsigned char* dst, const void* src, int bytes, int gran, int lane) {
    const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
    if (gran == 16) {
#pragma unroll 1
        for (int j = 16 * lane; j < bytes; j += 16 * 32) cp_async16(dst + j, s + j);
    } else if (gran == 8) {
#pragma unroll 1
        for (int j = 8 * lane; j < bytes; j += 8 * 32) cp_async8(dst + j, s + j);
    } else {
#pragma unroll 1
        for (int j = 4 * lane; j < bytes; j += 4 * 32) cp_async4(dst + j, s + j);
    }
}

// The lanes of a warp store `bytes` (a multiple of gran) of shared memory at src (16-byte
// aligned) to dst, gran bytes at a time.
__device__ __forceinline__ void store_row(void* dst, const unsigned char* src, int bytes, int gran, int lane) {
    unsigned char* d = reinterpret_cast<unsigned char*>(dst);
    if (gran == 16) {
#pragma unroll 1
        for (int j = 16 * lane; j < bytes; j += 16 * 32)
            *reinterpret_cast<uint4*>(d + j) = *reinterpret_cast<const uint4*>(src + j);
    } else if (gran == 8) {
#pragma unroll 1
        for (int j = 8 * lane; j < bytes; j += 8 * 32)
            *reinterpret_cast<uint2*>(d + j) = *reinterpret_cast<const uint2*>(src + j);
    } else {
#pragma unroll 1
        for (int j = 4 * lane; j < bytes; j += 4 * 32)
            *reinterpret_cast<kda_u32*>(d + j) = *reinterpret_cast<const kda_u32*>(src + j);
    }
}

// Whether an item has anything to compute (new tokens or a store).
__device__ __forceinline__ bool ring_work(const RingItem& it) { return it.nnew > 0 || it.pl.store_after != KDA_NONE; }

// Issues the copies of one item's token rows and dt_bias into a stage as one cp.async group
// (committed, empty for an item without work). Returns, loaded now and used when the item is
// computed, the raw beta of token threadIdx.x (< ntok; in the input type, not converted) and,
// in thread RT - 1, a_log.
__device__ __forceinline__ void ring_issue(unsigned char* st, const RingLayout& L, const KdaParams& p,
                                           const RingItem& it, IT& braw, float& alog) {
    const kda_u32 ntok = it.pl.pend + it.nnew;
    braw = KdaElem<IT>::from_f32(0.0f);
    alog = 0.0f;
    if (!ring_work(it)) {
        cp_async_commit();
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = (int)kda_div((kda_u32)it.hv, p.div_grp);
    const size_t entry = ring_entry_elems(p);
    const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)it.slot * p.ring_len * entry;
    // Warp w copies part w % 4 (q, k, g, v) of tokens w / 4, w / 4 + 2, ...: the row of token t
    // is at src_p + t entry for a pending entry (which holds no query), at src_n + (t - pend)
    // stride_n for a new token.
    static_assert(RT / 32 == 8, "two warps per part");
    const int part = warp & 3;
    const size_t hk = (size_t)p.h * K;
    const IT* src_p;
    const IT* src_n;
    size_t stride_n;
    unsigned char* dst;
    int bytes = K * (int)sizeof(IT), dstride = L.tokb;
    if (part == 0) {
        src_p = nullptr;
        src_n = reinterpret_cast<const IT*>(p.q) + ((size_t)it.bos * p.h + h) * K;
        stride_n = hk;
        dst = st + L.qrow - (int)it.pl.pend * RK; // new token t at row t - pend
        dstride = RK;
    } else if (part == 1) {
        src_p = ring + (size_t)h * K;
        src_n = reinterpret_cast<const IT*>(p.k) + ((size_t)it.bos * p.h + h) * K;
        stride_n = hk;
        dst = st;
    } else if (part == 2) {
        src_p = ring + ring_off_g(p, it.hv);
        src_n = reinterpret_cast<const IT*>(p.g) + ((size_t)it.bos * p.hv + it.hv) * K;
        stride_n = (size_t)p.hv * K;
        dst = st + RK;
    } else {
        src_p = ring + ring_off_v(p, it.hv) + it.cb;
        src_n = reinterpret_cast<const IT*>(p.v) + ((size_t)it.bos * p.hv + it.hv) * V + it.cb;
        stride_n = (size_t)p.hv * V;
        dst = st + 2 * RK;
        bytes = cmin(RCW, V - it.cb) * (int)sizeof(IT);
    }
    for (kda_u32 t = (kda_u32)(warp >> 2); t < ntok; t += 2) {
        const bool pending = t < it.pl.pend;
        if (pending && part == 0) continue;
        copy_row(dst + (int)t * dstride, pending ? src_p + t * entry : src_n + (t - it.pl.pend) * stride_n, bytes,
                 (int)p.ring_gran, lane);
    }
    if (p.gate_mode != 0u) {
        const float* bias = reinterpret_cast<const float*>(p.dt_bias) + (size_t)it.hv * K;
        static_assert(K / 4 <= RT, "one dt_bias chunk per thread");
        if ((int)threadIdx.x < K / 4) cp_async16(st + L.bias + 16 * threadIdx.x, bias + 4 * threadIdx.x);
    }
    cp_async_commit();
    if (threadIdx.x < ntok) {
        const kda_u32 t = threadIdx.x;
        const IT* b = t < it.pl.pend ? ring + (size_t)t * entry + ring_off_beta(p, it.hv)
                                     : reinterpret_cast<const IT*>(p.beta) + (size_t)(it.bos + t - it.pl.pend) * p.hv + it.hv;
        braw = *b; // converted where it is stored: a conversion here would wait for the load
    }
    if (threadIdx.x == RT - 1 && p.gate_mode != 0u) alog = reinterpret_cast<const float*>(p.a_log)[it.hv];
}

// Issues the copies of one item's state tile into the tile buffer as one cp.async group
// (committed, empty for an item without work; K-first swizzled like kda_eager's, V-first plain).
__device__ __forceinline__ void ring_issue_tile(unsigned char* tile, const KdaParams& p, const RingItem& it) {
    if (ring_work(it)) {
        const ST* head = state_head(p, it.slot, it.hv);
        tile_issue(tile, head, it.cb, RCW, cmin(RCW, V - it.cb));
    }
    cp_async_commit();
}

// The CTA copies n words of W from s to d, four loads in flight per thread.
// (Loops not unrolled further: the kernel's code stays small.)
template <typename W> __device__ __forceinline__ void cta_copy(W* d, const W* s, size_t n) {
    size_t i = threadIdx.x;
#pragma unroll 1
    for (; i + 3 * RT < n; i += 4 * RT) {
        const W a = s[i], b = s[i + RT], c = s[i + 2 * RT], e = s[i + 3 * RT];
        d[i] = a;
        d[i + RT] = b;
        d[i + 2 * RT] = c;
        d[i + 3 * RT] = e;
    }
#pragma unroll 1
    for (; i < n; i += RT) d[i] = s[i];
}

// The CTA copies `bytes` (a multiple of gran) from s to d in words of gran bytes.
__device__ __forceinline__ void cta_copy_bytes(void* d, const void* s, size_t bytes, int gran) {
    if (gran == 16) {
        cta_copy(reinterpret_cast<uint4*>(d), reinterpret_cast<const uint4*>(s), bytes / 16);
    } else if (gran == 8) {
        cta_copy(reinterpret_cast<uint2*>(d), reinterpret_cast<const uint2*>(s), bytes / 8);
    } else {
        cta_copy(reinterpret_cast<kda_u32*>(d), reinterpret_cast<const kda_u32*>(s), bytes / 4);
    }
}

// A commit's new ring entries 0..nnew of a whole slot, from the call's inputs (every thread of
// the CTA; a ring entry holds one token's k, v, g rows of all heads, then its betas).
__device__ __forceinline__ void ring_commit_copy(const KdaParams& p, kda_u32 slot, kda_u32 bos, kda_u32 nnew) {
    const size_t entry = ring_entry_elems(p);
    const size_t hk = (size_t)p.h * K, hvv = (size_t)p.hv * V, hvk = (size_t)p.hv * K;
    const int gran = (int)p.ring_gran;
    IT* ring = reinterpret_cast<IT*>(p.ring) + (size_t)slot * p.ring_len * entry;
    for (kda_u32 j = 0; j < nnew; ++j) {
        const size_t tok = bos + j;
        IT* e = ring + (size_t)j * entry;
        // one copy loop for the three rows (k, v, g) (code size: see the header)
#pragma unroll 1
        for (int part = 0; part < 3; ++part) {
            const size_t n = part == 0 ? hk : part == 1 ? hvv : hvk;
            const IT* src = reinterpret_cast<const IT*>(part == 0 ? p.k : part == 1 ? p.v : p.g) + tok * n;
            const size_t at = part == 0 ? 0 : part == 1 ? ring_off_v(p, 0) : ring_off_g(p, 0);
            cta_copy_bytes(e + at, src, n * sizeof(IT), gran);
        }
        for (size_t i = threadIdx.x; i < p.hv; i += RT)
            e[ring_off_beta(p, i)] = reinterpret_cast<const IT*>(p.beta)[tok * p.hv + i];
    }
}

// What the bookkeeper remembers of the item whose arrival it has not looked at yet.
struct RingArrival {
    kda_u32 slot, new_len, new_pending, bos, nnew;
    bool copy; // a commit with new tokens: the last item's CTA writes the entries
};

// The bookkeeper, once the previous item's arrival is known (`last`: it was the slot's last item):
// the slot's new record, and (s_copy; KDA_NONE otherwise) the entries a commit left to write.
__device__ __forceinline__ void ring_settle(const RingArrival& prev, bool last, kda_u32* metas, kda_u32* s_copy) {
    s_copy[0] = KDA_NONE;
    if (prev.slot != KDA_NONE && last) {
        kda_u32* m = metas + (size_t)prev.slot * 4;
        m[0] = prev.new_len;
        m[1] = prev.new_pending;
        m[2] = 0u;
        m[3] = 0u; // no delta vectors stored (kda_ring_delta's)
        if (prev.copy) {
            s_copy[0] = prev.slot;
            s_copy[1] = prev.bos;
            s_copy[2] = prev.nnew;
        }
    }
}

// A dependent launch (p.early), before its wait: the first item's state tile and its head's
// rows of every ring entry (the pending count is not known before the wait) go into L2 while
// the grid before this one finishes (see eager_prefetch_first: only hints and host-written
// slots before the wait).
__device__ __forceinline__ void ring_prefetch_first(const KdaParams& p) {
#if KDA_GRID_DEPENDENCY
    if (p.early == 0u || blockIdx.x >= live_seqs(p) * p.hv * p.vblocks) return;
    RingItem it;
    ring_coords(p, blockIdx.x, it);
    const kda_u32 slot = early_slot(p, it.n);
    const int cwv = cmin(RCW, V - it.cb);
    prefetch_tile(state_head(p, slot, it.hv), it.cb, cwv);
    // one row (k, g, v of the item's columns) of one entry per thread
    const size_t entry = ring_entry_elems(p);
    const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)slot * p.ring_len * entry;
    const kda_u32 t = threadIdx.x / 3, part = threadIdx.x - 3 * t;
    if (t < p.ring_len) {
        const IT* e = ring + (size_t)t * entry;
        const size_t h = kda_div((kda_u32)it.hv, p.div_grp);
        if (part == 0) prefetch_range(e + h * K, K * sizeof(IT), 0, 1);
        else if (part == 1) prefetch_range(e + ring_off_g(p, it.hv), K * sizeof(IT), 0, 1);
        else prefetch_range(e + ring_off_v(p, it.hv) + it.cb, (size_t)cwv * sizeof(IT), 0, 1);
    }
#endif
}

} // namespace kda

extern "C" __global__ void __launch_bounds__(kda::RT, 2) kda_ring(const KdaParams p) {
    kda::ring_prefetch_first(p);
    // The bookkeeper's first four slots, loaded before the wait (host-written, early_slot).
    kda_u32 sl[4];
    const kda_u32 live_items = kda::live_seqs(p) * p.hv * p.vblocks;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const kda_u32 it = blockIdx.x + (kda_u32)j * gridDim.x;
        const bool mine = threadIdx.x == kda::RT - 32 && it < live_items;
        sl[j] = mine ? kda::early_slot(p, kda::ring_seq(p, it)) : 0u;
    }
    KDA_DEPENDENT_LAUNCH();
    extern __shared__ __align__(16) unsigned char dsm[];
    // The items of this CTA in flight: item j (the CTA's j-th) in s_items[j % 3], written by the
    // bookkeeper one iteration before its copies are issued.
    __shared__ RingItem s_items[3];
    // slot, bos, nnew of entries this CTA must write (KDA_NONE: none): written by the bookkeeper
    // in iteration i at [i & 1], read by every thread in iteration i + 1
    __shared__ kda_u32 s_copy[2][3];
    __shared__ RingArrival s_prev; // the bookkeeper's: the previous item's arrival

    constexpr int BK = RT - 32; // the bookkeeper: lane 0 of the last warp
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int lk = lane / LV, lv = lane % LV;
    const RingLayout L((int)p.ring_mt, (int)p.ring_mq);
    float* ka = reinterpret_cast<float*>(dsm + L.ka);
    float* da = reinterpret_cast<float*>(dsm + L.da);
    float* qa = reinterpret_cast<float*>(dsm + L.qa); // new token t at row t - pend
    float* va = reinterpret_cast<float*>(dsm + L.va);
    float* sbeta = reinterpret_cast<float*>(dsm + L.sbeta);
    float* braw_s = reinterpret_cast<float*>(dsm + L.braw);
    float* alog_s = reinterpret_cast<float*>(dsm + L.alog);

    const kda_u32 per_seq = p.hv * p.vblocks;
    const kda_u32 total = live_items;
    const kda_u32 grid = gridDim.x;
    kda_u32* metas = reinterpret_cast<kda_u32*>(p.meta);
    const kda_u32* slots = reinterpret_cast<const kda_u32*>(p.slots);
    const int group = (int)(p.hv / p.h);
    const size_t entry = ring_entry_elems(p);

    kda_u32 item = blockIdx.x;
    if (item >= total) return;
    // The bookkeeper's look-ahead (its registers; unused in the other threads): the record of
    // the item two ahead of the current one, the slot of the item three ahead, and the previous
    // item's arrival (its atomic's result).
    RingRec rec = {};
    kda_u32 la_slot = 0, prev_old = 0;
    // Prologue (bookkeeper): with the slots of the first four items (loaded before the wait),
    // the records of the first three (every load issued before the first plan, whose error
    // atomic would order them after it), the plans of the first two.
    if (threadIdx.x == BK) {
        RingRec r[3] = {};
#pragma unroll
        for (int j = 0; j < 3; ++j) {
            const kda_u32 it = item + (kda_u32)j * grid;
            if (it < total) r[j] = ring_rec_load(p, it, sl[j]);
        }
        s_items[0] = ring_item(p, item, r[0]);
        if (item + grid < total) s_items[1] = ring_item(p, item + grid, r[1]);
        rec = r[2];
        la_slot = sl[3];
        s_copy[0][0] = s_copy[1][0] = KDA_NONE;
        s_prev.slot = KDA_NONE; // no arrival yet
    }
    __syncthreads();
    // cp.async groups, oldest first: this item's token rows, this item's tile, the next item's
    // token rows (issued at the top of an iteration), the next item's tile (issued once this
    // item's tile is in registers)
    IT braw_next;
    float alog_next;
    ring_issue(dsm + RTILE, L, p, s_items[0], braw_next, alog_next);
    ring_issue_tile(dsm, p, s_items[0]);
    kda_u32 issued = item + grid;

    int i = 0;
    int j0 = 0, j1 = 1, j2 = 2; // i % 3, (i + 1) % 3, (i + 2) % 3
    for (; item < total; item += grid, ++i) {
        const int stage = i & 1;
        unsigned char* st = dsm + RTILE + stage * L.stage;
        // this item's raw betas and a_log (loaded when it was issued)
        if ((int)threadIdx.x < MTC) braw_s[stage * MTC + threadIdx.x] = kda_load(braw_next);
        if (threadIdx.x == RT - 1) alog_s[stage] = alog_next;
        cp_async_wait<1>(); // this item's token rows (its tile may still be in flight)
        __syncthreads();
        // entries of a committed slot this CTA arrived last on (published by the bookkeeper)
        const kda_u32* cp = s_copy[stage ^ 1];
        if (cp[0] != KDA_NONE) ring_commit_copy(p, cp[0], cp[1], cp[2]);
        const RingItem me = s_items[j0];

        // issue the next item
        const bool more = issued < total;
        if (more) {
            ring_issue(dsm + RTILE + (stage ^ 1) * L.stage, L, p, s_items[j1], braw_next, alog_next);
            issued += grid;
        } else {
            cp_async_commit();
        }
        if (threadIdx.x == BK) {
            // the previous item's arrival, then this one's: its token rows are in shared memory
            // (the barrier above), so it has read all it reads of the ring. No fence: those
            // reads are complete, which is all the last item's writes must come after.
            ring_settle(s_prev, prev_old == per_seq - 1, metas, s_copy[stage]);
            prev_old = atomicAdd(metas + (size_t)me.slot * 4 + 2, 1u);
            s_prev.slot = me.slot;
            s_prev.new_len = me.pl.new_len;
            s_prev.new_pending = me.pl.new_pending;
            s_prev.bos = me.bos;
            s_prev.nnew = me.nnew;
            s_prev.copy = me.pl.store_after != KDA_NONE && me.pl.append_at != KDA_NONE && me.nnew > 0;
            // the plan of the item after the next (its record was loaded an iteration ago), then
            // the loads for the ones after it
            if (issued < total) {
                s_items[j2] = ring_item(p, issued, rec);
                if (issued + grid < total) {
                    rec = ring_rec_load(p, issued + grid, la_slot);
                    if (issued + 2 * grid < total) la_slot = slots[ring_seq(p, issued + 2 * grid)];
                }
            }
        }

        const kda_u32 pend = me.pl.pend, nnew = me.nnew;
        const int ntok = (int)(pend + nnew);
        const bool store = me.pl.store_after != KDA_NONE;
        const int cwv = cmin(RCW, V - me.cb);
        const unsigned char* tokrow = st;
        if (nnew > 0 || store) {
            // 1) activations, one warp per unit: units 0..ntok are the tokens (key, decays, values
            // of the item's columns, beta), the next ones the queries of the new tokens (a
            // warp of their own: the new token's warp finished last)
            const float a_exp = p.gate_mode ? expf(alog_s[stage]) : 0.0f;
            const float* bias = reinterpret_cast<const float*>(st + L.bias);
            for (int u = warp; u < ntok + (int)nnew; u += RT / 32) {
                if (u >= ntok) {
                    const int f = u - ntok; // the query of new token pend + f
                    act_row(reinterpret_cast<const IT*>(st + L.qrow + f * RK), qa + f * KS, p.l2norm != 0u, true,
                            p.scale, lane);
                    for (int kk = K + lane; kk < KS; kk += 32) qa[f * KS + kk] = 0.0f;
                    continue;
                }
                const int t = u;
                const unsigned char* row = tokrow + t * L.tokb;
                act_row(reinterpret_cast<const IT*>(row), ka + t * KS, p.l2norm != 0u, false, p.scale, lane);
                act_decay(reinterpret_cast<const IT*>(row + RK), bias, da + t * KS, p, a_exp, lane);
                for (int kk = K + lane; kk < KS; kk += 32) {
                    ka[t * KS + kk] = 0.0f;
                    da[t * KS + kk] = 1.0f;
                }
                const IT* rv = reinterpret_cast<const IT*>(row + 2 * RK);
                for (int c = lane; c < cwv; c += 32) va[t * RCW + c] = kda_load(rv[c]);
                if (lane == 0) sbeta[t] = act_beta(braw_s[stage * MTC + t], p);
            }
            cp_async_wait<1>(); // this item's tile (the next item's token rows may be in flight)
            __syncthreads();

            // 2) each warp steps its columns through the tokens (kda_step's token step); the next
            // item's tile is copied into the buffer once every warp holds this one in registers
            float s[TK][TV];
            const int col0l = warp * WC + lv * TV;
            tile_from_stage(reinterpret_cast<const ST*>(dsm), lk, col0l, cwv, RCW, s);
            __syncthreads();
            if (more) {
                ring_issue_tile(dsm, p, s_items[j1]);
            } else {
                cp_async_commit();
            }
            const int col0 = me.cb + col0l;
            ST* head = state_head(p, me.slot, me.hv);
            const kda_u32 elem0 = (kda_u32)me.hv * (kda_u32)(K * V);
            // the pending entries, a commit's store after them, then the new tokens with their
            // read-outs (as kda_ring_tile: two loops)
            float o[TV];
            for (int t = 0; t < (int)pend; ++t)
                token_step<true>(s, ka + t * KS, da + t * KS, qa, va + t * RCW + col0l, cwv - col0l, sbeta[t], lk,
                                 false, o);
            // nearest rounding only: the host runs kda_step for stochastic-rounding pools (the
            // hash and the fp16 rounding would take registers from the token loop); streaming
            // stores, as no item reads the committed state again soon (2-byte ring and spec
            // 2.5-3.3% faster on the H200, docs/performance.md, ninth session)
            if (me.pl.store_after == pend && pend > 0) store_tile<false, true>(head, lk, col0, s, 0u, elem0);
            for (int t = (int)pend; t < ntok; ++t) {
                token_step<true>(s, ka + t * KS, da + t * KS, qa + (t - (int)pend) * KS, va + t * RCW + col0l,
                                 cwv - col0l, sbeta[t], lk, true, o);
                if (lk == 0 && col0 < V) {
                    const size_t tok = me.bos + ((kda_u32)t - pend);
                    store_out(reinterpret_cast<IT*>(p.out) + (tok * p.hv + me.hv) * V + col0, o, col0);
                }
            }

            // 3) no commit: this item's part of the new entries (rows past the pending
            // entries: no item of this call reads them), one warp per row in whole words, the
            // last warps first (the first ones activate the next item's first tokens); the
            // k row, the g row and the raw beta from the head's first column block, the k row
            // from the first value head of its group
            if (!store && me.pl.append_at != KDA_NONE && nnew > 0) {
                for (int ri = RT / 32 - 1 - warp; ri < (int)nnew * 3; ri += RT / 32) {
                    const int j = ri / 3, part = ri - 3 * j; // 0: k and beta, 1: g, 2: v
                    if (part < 2 && me.cb != 0) continue;
                    const int h = (int)kda_div((kda_u32)me.hv, p.div_grp);
                    const int t = (int)pend + j;
                    const unsigned char* row = tokrow + t * L.tokb;
                    IT* e = reinterpret_cast<IT*>(p.ring) +
                            ((size_t)me.slot * p.ring_len + me.pl.append_at + (kda_u32)j) * entry;
                    if (part == 0 && lane == 0)
                        e[ring_off_beta(p, me.hv)] = KdaElem<IT>::from_f32(braw_s[stage * MTC + t]);
                    if (part == 0 && me.hv != h * group) continue; // the group's first value head writes k
                    store_row(e + (part == 0   ? (size_t)h * K
                                   : part == 1 ? ring_off_g(p, me.hv)
                                               : ring_off_v(p, me.hv) + me.cb),
                              row + part * RK, (part == 2 ? cwv : K) * (int)sizeof(IT), (int)p.ring_gran, lane);
                }
            }
        } else if (more) {
            // no tile to read: the next item's tile goes into the buffer now
            ring_issue_tile(dsm, p, s_items[j1]);
        } else {
            cp_async_commit();
        }
        const int jn = j0;
        j0 = j1;
        j1 = j2;
        j2 = jn;
    }
    cp_async_wait<0>();
    // the last iteration's publication (e = i - 1), then the last item's arrival (e = i): one
    // inlined copy for both
#pragma unroll 1
    for (int e = i - 1; e <= i; ++e) {
        __syncthreads();
        if (e == i && threadIdx.x == BK) ring_settle(s_prev, prev_old == per_seq - 1, metas, s_copy[e & 1]);
        __syncthreads();
        const kda_u32* cp = s_copy[e & 1];
        if (cp[0] != KDA_NONE) ring_commit_copy(p, cp[0], cp[1], cp[2]);
    }
}

// ---------------------------------------------------------------------------------------------
// Decode, spec_verify and replay over the replay ring, one item per CTA (kda_ring_tile): the
// default for small ring decode and replay calls and for spec_verify calls of many items (how
// many depends on the drafts and the pool), where it measured faster than kda_ring
// (`ring_choice` in ring_plan.rs; docs/performance.md, eighteenth and nineteenth sessions). An
// item is kda_ring's (sequence, value head, block of RCW columns), item = blockIdx.x, and the
// grid covers the items: two CTAs per SM keep each other's loads in flight instead of a
// pipeline. Thread 0 reads the ring record while the new tokens' rows are copied (cp.async);
// once the plan is known the pending entries' rows are copied and then the state tile goes
// straight into registers (its loads after the rows', which the activations wait for: the
// tile is needed only later; docs/performance.md, twenty-seventh session). Then the keys and
// queries are activated a warp per row, the decays and values over all threads, and each warp
// steps its columns through the tokens with kda_step's token step: the same bits. Nearest
// rounding only, as kda_ring.
// Ring data as in kda_ring: without a commit each CTA appends its part of the new entries; a
// commit's entries are written by the CTA that arrives last on the slot's counter (each CTA
// arrives once its ring reads are done, and looks at the result at its end), which also writes
// the new record.
namespace kda {

// Byte offsets in dynamic shared memory (mirrored by `ring_plan` in ring_plan.rs): mt raw
// token rows of tokb bytes (k and g: RK each, then v of the item's columns; new token j at row j,
// pending entry t at row mq + t), the new tokens' raw queries [mq][RK], dt_bias (f32 [K]), then
// f32 arrays: ka, da [mt][KS] (activated keys, decays; by combined token), qa [mq][KS] (queries),
// va [mt][RCW] (values), beta [mt].
struct RingTileLayout {
    int tokb, qrow, bias, ka, da, qa, va, sbeta;
    __device__ __forceinline__ RingTileLayout(int mt, int mq) {
        tokb = 2 * RK + round16(RCW * (int)sizeof(IT));
        qrow = mt * tokb;
        bias = qrow + mq * RK;
        ka = bias + round16(K * 4);
        da = ka + 4 * mt * KS;
        qa = da + 4 * mt * KS;
        va = qa + 4 * mq * KS;
        sbeta = va + 4 * mt * RCW; // then round16(4 mt) bytes: the end
    }
};

// Prefetches into L2 the rows an item reads of every ring entry of its slot (k of its head h,
// g, beta and v of its columns of value head hv), a warp per row. The pending ones are known only
// once the plan is, after the wait; a dependent launch asks for all of them before it (docs/
// performance.md, twentieth session: ring decode 2-9% faster up to 128 items; before the tile's
// loads of a plain launch, spec_verify and replay measured 1-7% slower).
__device__ __forceinline__ void prefetch_ring_rows(const KdaParams& p, kda_u32 slot, int h, int hv, int cb, int cwv) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t entry = ring_entry_elems(p);
    const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)slot * p.ring_len * entry;
    for (int r = warp; r < 4 * (int)p.ring_len; r += RT / 32) {
        const int t = r / 4, part = r - 4 * t;
        const IT* e = ring + (size_t)t * entry;
        if (part == 0)
            prefetch_range(e + (size_t)h * K, K * sizeof(IT), lane);
        else if (part == 1)
            prefetch_range(e + ring_off_g(p, hv), K * sizeof(IT), lane);
        else if (part == 2)
            prefetch_range(e + ring_off_v(p, hv) + cb, cwv * sizeof(IT), lane);
        else
            prefetch_range(e + ring_off_beta(p, hv), sizeof(IT), lane);
    }
}


// The one-item-per-CTA ring kernels' (kda_ring_tile, kda_ring_mma) shared steps. LT: the
// kernel's shared-memory layout (its token rows: tokb, qrow, bias, sbeta as RingTileLayout's).

// What an item of the one-item-per-CTA kernels knows (item = blockIdx.x): sequence n, its
// slot, value head hv (q/k head h, group value heads per q/k head), first column cb, columns
// cwv, the sequence's new tokens bos .. bos + nnew; once its plan's loads are issued
// (tile_plan_loads) the slot's ring record `meta`.
struct TileItem {
    kda_u32 item, per_seq, n, slot;
    int hv, cb, cwv, h;
    kda_u32* meta;
    kda_u32 bos, nnew;
    int group;
};

// The item's coordinates, slot and new tokens (the host's: read before the wait, early_u32), a
// dependent launch's L2 prefetches, then the wait. WHOLE: every item has RCW columns (the host
// checked); CTAS: the kernel's CTAs per SM (its launch bounds).
template <bool WHOLE = false, int CTAS = 2> __device__ __forceinline__ TileItem tile_item_begin(const KdaParams& p) {
    TileItem it;
    it.item = blockIdx.x;
    it.per_seq = p.hv * p.vblocks;
    it.n = kda_div(it.item, p.div_seq);
    const kda_u32 rem = it.item - it.n * it.per_seq;
    it.hv = (int)kda_div(rem, p.div_vb);
    it.cb = (int)(rem - (kda_u32)it.hv * p.vblocks) * RCW;
    it.cwv = WHOLE ? RCW : cmin(RCW, V - it.cb);
    it.slot = early_slot(p, it.n);
    // (with the slot: read after the wait they were a round trip on the way to the new rows)
    it.bos = early_u32(p.bounds, it.n);
    it.nnew = early_u32(p.bounds, it.n + 1) - it.bos;
    it.h = (int)kda_div((kda_u32)it.hv, p.div_grp);
    it.group = (int)(p.hv / p.h);
#if KDA_GRID_DEPENDENCY
    // only from the CTAs that can start before the previous grid ends (the first CTAS per SM):
    // a later CTA's wait returns at once. Its ring rows' prefetch loop was ~16% of
    // kda_ring_delta's instructions in ring decode (3-8% faster without, twenty-sixth session),
    // and its tile's prefetch, right at its start, competed with the rows its activations wait
    // for (1.6-6.8% faster without, twenty-seventh session; docs/performance.md). (The inner
    // test again is what was measured: without it the SASS differs.)
    if (p.early != 0u && it.item < (kda_u32)CTAS * sm_count()) {
        prefetch_tile(state_head(p, it.slot, it.hv), it.cb, it.cwv);
        if (it.item < (kda_u32)CTAS * sm_count()) prefetch_ring_rows(p, it.slot, it.h, it.hv, it.cb, it.cwv);
    }
#endif
    KDA_DEPENDENT_LAUNCH();
    return it;
}

// What an item's plan needs, loaded after the wait: thread 0 the slot's ring record (length,
// pending entries, accepted drafts), thread 32 a_log of the value head (on another warp than
// the record's, so neither load waits for the other); nothing in the other threads. The
// kernels issue their new rows' copies before they wait for these (tile_plan_finish).
struct TilePlanLoads {
    kda_u32 len, pend, acc;
    float alog;
};
__device__ __forceinline__ TilePlanLoads tile_plan_loads(const KdaParams& p, TileItem& it) {
    it.meta = reinterpret_cast<kda_u32*>(p.meta) + (size_t)it.slot * 4;
    TilePlanLoads l{0u, 0u, 0u, 0.0f};
    if (threadIdx.x == 0) {
        const volatile kda_u32* vm = it.meta;
        l.len = vm[0];
        l.pend = vm[1];
        l.acc = p.accepted ? reinterpret_cast<const kda_u32*>(p.accepted)[it.n] : 0u;
    }
    if (threadIdx.x == 32 && p.gate_mode) l.alog = reinterpret_cast<const float*>(p.a_log)[it.hv];
    return l;
}

// Thread 0 plans the item into s_plan; thread 32 puts exp(a_log) into s_aexp (in shared memory:
// a register of every thread across the tile's loads spilled).
__device__ __forceinline__ void tile_plan_finish(const KdaParams& p, const TileItem& it, const TilePlanLoads& l,
                                                 Plan& s_plan, float& s_aexp) {
    if (threadIdx.x == 0)
        s_plan = plan_from(p, it.slot, it.nnew, l.len, l.pend, l.acc, reinterpret_cast<kda_u32*>(p.err),
                           it.hv == 0 && it.cb == 0);
    if (threadIdx.x == 32) s_aexp = p.gate_mode ? expf(l.alog) : 0.0f;
}

// Once every ring read of the CTA is done: thread 0 arrives on the slot's counter and returns
// the count before it (looked at at the end, tile_settle); 0 in the other threads.
__device__ __forceinline__ kda_u32 tile_arrive(kda_u32* meta) {
    kda_u32 old = 0u;
    if (threadIdx.x == 0) old = atomicAdd(meta + 2, 1u);
    return old;
}

// Copies the new tokens' rows (they do not depend on the plan): q, k, g, v of token j at rows
// 4 j .. 4 j + 3 of the copy list, one warp per row; then dt_bias. Not committed.
template <typename LT>
__device__ __forceinline__ void tile_new_rows(unsigned char* dsm, const LT& L, const KdaParams& p, kda_u32 bos,
                                              kda_u32 nnew, int h, int hv, int cb, int cwv, int gran) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < 4 * (int)nnew; r += RT / 32) {
        const int j = r >> 2, part = r & 3;
        const size_t tok = bos + (size_t)j;
        const IT* src;
        unsigned char* dst;
        int bytes = K * (int)sizeof(IT);
        if (part == 0) {
            src = reinterpret_cast<const IT*>(p.q) + (tok * p.h + h) * K;
            dst = dsm + L.qrow + j * RK;
        } else if (part == 1) {
            src = reinterpret_cast<const IT*>(p.k) + (tok * p.h + h) * K;
            dst = dsm + j * L.tokb;
        } else if (part == 2) {
            src = reinterpret_cast<const IT*>(p.g) + (tok * p.hv + hv) * K;
            dst = dsm + j * L.tokb + RK;
        } else {
            src = reinterpret_cast<const IT*>(p.v) + (tok * p.hv + hv) * V + cb;
            dst = dsm + j * L.tokb + 2 * RK;
            bytes = cwv * (int)sizeof(IT);
        }
        copy_row(dst, src, bytes, gran, lane);
    }
    if (p.gate_mode != 0u && (int)threadIdx.x < K / 4) {
        const float* bias = reinterpret_cast<const float*>(p.dt_bias) + (size_t)hv * K;
        cp_async16(dsm + L.bias + 16 * threadIdx.x, bias + 4 * threadIdx.x);
    }
}

// Copies the pending entries' rows (k, g, v at rows mq + t) as one committed group, and
// activates the betas (thread t: combined token t) into sbeta. `replay`: whether the caller
// replays the pending entries; without it their values and betas are not read (kda_ring_delta's
// short path, whose stored vectors hold them).
template <typename LT>
__device__ __forceinline__ void tile_pending_rows(unsigned char* dsm, const LT& L, const KdaParams& p, const IT* ring,
                                                  size_t entry, int pend, int ntok, int mq, kda_u32 bos, int h,
                                                  int hv, int cb, int cwv, int gran, bool replay = true) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int parts = replay ? 3 : 2;
    for (int r = warp; r < parts * pend; r += RT / 32) {
        const int t = r / parts, part = r - parts * t;
        const IT* e = ring + (size_t)t * entry;
        unsigned char* dst = dsm + (mq + t) * L.tokb + part * RK;
        const IT* src = part == 0 ? e + (size_t)h * K : part == 1 ? e + ring_off_g(p, hv) : e + ring_off_v(p, hv) + cb;
        copy_row(dst, src, part == 2 ? cwv * (int)sizeof(IT) : K * (int)sizeof(IT), gran, lane);
    }
    cp_async_commit();
    float* sbeta = reinterpret_cast<float*>(dsm + L.sbeta);
    if ((int)threadIdx.x < ntok && (replay || (int)threadIdx.x >= pend)) {
        const int t = (int)threadIdx.x;
        const IT* b = t < pend ? ring + (size_t)t * entry + ring_off_beta(p, hv)
                               : reinterpret_cast<const IT*>(p.beta) + (bos + (size_t)(t - pend)) * p.hv + hv;
        sbeta[t] = act_beta(kda_load(*b), p);
    }
}

// Without a commit: this CTA's part of the new entries from their raw rows (rows past the
// pending entries: no CTA of this call reads them): v of its columns; g and beta from the
// head's first block; k from the group's first value head. (kda_ring's append, written again: a
// shared helper would change kda_ring's code, whose speed depends on its size, and its betas
// come from shared memory.)
template <typename LT>
__device__ __forceinline__ void tile_append(const unsigned char* dsm, const LT& L, const KdaParams& p, kda_u32 slot,
                                            kda_u32 append_at, kda_u32 bos, kda_u32 nnew, int h, int hv, int group,
                                            int cb, int cwv, int gran, size_t entry) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < 3 * (int)nnew; r += RT / 32) {
        const int j = r / 3, part = r - 3 * j; // 0: k and beta, 1: g, 2: v
        if (part < 2 && cb != 0) continue;
        IT* e = reinterpret_cast<IT*>(p.ring) + ((size_t)slot * p.ring_len + append_at + (kda_u32)j) * entry;
        if (part == 0 && lane == 0)
            e[ring_off_beta(p, hv)] = reinterpret_cast<const IT*>(p.beta)[(bos + (size_t)j) * p.hv + hv];
        if (part == 0 && hv != h * group) continue;
        store_row(e + (part == 0 ? (size_t)h * K : part == 1 ? ring_off_g(p, hv) : ring_off_v(p, hv) + cb),
                  dsm + j * L.tokb + part * RK, (part == 2 ? cwv : K) * (int)sizeof(IT), gran, lane);
    }
}

// The lane's part of an item's tile (columns col0.., V for none): its words for a 2-byte pool
// (TILE_WORDS: converted where the tile is first needed, so the loads stay in flight), else
// its f32 values.
__device__ __forceinline__ void tile_load_lane(const ST* head, int lk, int col0, kda_u32 (&w)[TW],
                                               float (&s)[TK][TV]) {
    if constexpr (TILE_WORDS) {
        load_tile_words(head, lk, col0, w);
    } else {
        load_tile(head, lk, col0, s);
    }
}

// The f32 arrays of RingTileLayout: activated keys, decays, queries and values.
struct TileRows {
    float *ka, *da, *qa, *va;
    __device__ __forceinline__ TileRows(unsigned char* dsm, const RingTileLayout& L)
        : ka(reinterpret_cast<float*>(dsm + L.ka)), da(reinterpret_cast<float*>(dsm + L.da)),
          qa(reinterpret_cast<float*>(dsm + L.qa)), va(reinterpret_cast<float*>(dsm + L.va)) {}
};

// kda_ring_tile's and kda_ring_delta's activations (RingTileLayout): the keys (combined token t
// from raw row t < pend ? mq + t : t - pend) and the new tokens' queries a warp per row into
// ka and qa; the decays and the values (of combined tokens vfrom..) over all threads into da
// and va. Not followed by a barrier. FAST_NORM, FAST_DECAY: act_row's, decay_of's approximate
// arithmetic.
template <bool FAST_NORM = false, bool FAST_DECAY = false>
__device__ __forceinline__ void tile_activate(unsigned char* dsm, const RingTileLayout& L, const TileRows& r,
                                              const KdaParams& p, int pend, int ntok, int nnew, int mq, int cwv,
                                              float a_exp, int warp, int lane, int vfrom = 0) {
    float *ka = r.ka, *da = r.da, *qa = r.qa, *va = r.va;
    const float* bias = reinterpret_cast<const float*>(dsm + L.bias);
    auto raw = [&](int t) { return dsm + (t < pend ? mq + t : t - pend) * L.tokb; };
    for (int u = warp; u < ntok + nnew; u += RT / 32) {
        if (u < ntok) {
            act_row<FAST_NORM>(reinterpret_cast<const IT*>(raw(u)), ka + u * KS, p.l2norm != 0u, false, p.scale,
                               lane);
            for (int kk = K + lane; kk < KS; kk += 32) ka[u * KS + kk] = 0.0f;
        } else {
            const int f = u - ntok;
            act_row<FAST_NORM>(reinterpret_cast<const IT*>(dsm + L.qrow + f * RK), qa + f * KS, p.l2norm != 0u,
                               true, p.scale, lane);
            for (int kk = K + lane; kk < KS; kk += 32) qa[f * KS + kk] = 0.0f;
        }
    }
    for (int i = (int)threadIdx.x; i < ntok * KS; i += RT) {
        const int t = i / KS, kk = i - t * KS;
        da[i] = kk < K ? decay_of<FAST_DECAY>(reinterpret_cast<const IT*>(raw(t) + RK), bias, kk, p, a_exp) : 1.0f;
    }
    for (int i = vfrom * RCW + (int)threadIdx.x; i < ntok * RCW; i += RT) {
        const int t = i / RCW, c = i - t * RCW;
        va[i] = c < cwv ? kda_load(reinterpret_cast<const IT*>(raw(t) + 2 * RK)[c]) : 0.0f;
    }
}

// The end of an item (every thread): the last CTA of the slot to arrive (`old`, the counter
// before this CTA's arrival) writes the new record, and a commit's new entries.
// `cached`: the ring entries 0.. whose delta vectors the delta plane holds after the call (only
// kda_ring_delta stores them; 0 from the others).
__device__ __forceinline__ void tile_settle(const KdaParams& p, const Plan& pl, kda_u32 old, kda_u32 per_seq,
                                            bool store, kda_u32* meta, kda_u32 slot, kda_u32 bos, kda_u32 nnew,
                                            kda_u32& s_last, kda_u32 cached = 0u) {
    if (threadIdx.x == 0) {
        const bool last = old == per_seq - 1;
        if (last) {
            meta[0] = pl.new_len;
            meta[1] = pl.new_pending;
            meta[2] = 0u;
            meta[3] = cached;
        }
        s_last = last && store && pl.append_at != KDA_NONE && nnew > 0;
    }
    __syncthreads();
    if (s_last) ring_commit_copy(p, slot, bos, nnew);
}
} // namespace kda

extern "C" __global__ void __launch_bounds__(kda::RT, 2) kda_ring_tile(const KdaParams p) {
    using namespace kda;
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ Plan s_plan;
    __shared__ float s_aexp;
    __shared__ kda_u32 s_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int lk = lane / LV, lv = lane % LV;
    if (padding_cta(p)) return;
    TileItem it = tile_item_begin(p);
    const RingTileLayout L((int)p.ring_mt, (int)p.ring_mq);
    const int mq = (int)p.ring_mq;
    // the plan's loads, the new tokens' rows, the plan; the tile after the pending rows (below)
    const TilePlanLoads pl0 = tile_plan_loads(p, it);
    const kda_u32 per_seq = it.per_seq, slot = it.slot, bos = it.bos, nnew = it.nnew;
    const int hv = it.hv, cb = it.cb, cwv = it.cwv, h = it.h, group = it.group;
    kda_u32* meta = it.meta;
    ST* head = state_head(p, slot, (size_t)hv);
    const int col0l = warp * WC + lv * TV, col0 = cb + col0l;
    float s[TK][TV];
    kda_u32 w[TW];
    const int gran = (int)p.ring_gran;
    tile_new_rows(dsm, L, p, bos, nnew, h, hv, cb, cwv, gran);
    cp_async_commit();
    tile_plan_finish(p, it, pl0, s_plan, s_aexp);
    __syncthreads();
    const Plan pl = s_plan;
    const int pend = (int)pl.pend, ntok = pend + (int)nnew;
    const bool store = pl.store_after != KDA_NONE;
    const bool work = nnew > 0 || store;
    const size_t entry = ring_entry_elems(p);
    const IT* ring = reinterpret_cast<const IT*>(p.ring) + (size_t)slot * p.ring_len * entry;
    if (work) tile_pending_rows(dsm, L, p, ring, entry, pend, ntok, mq, bos, h, hv, cb, cwv, gran);
    tile_load_lane(head, lk, col0l < cwv ? col0 : V, w, s);
    cp_async_wait<0>();
    __syncthreads();
    const kda_u32 old = tile_arrive(meta);
    if (work) {
        const TileRows rows(dsm, L);
        float *ka = rows.ka, *da = rows.da, *qa = rows.qa, *va = rows.va;
        tile_activate(dsm, L, rows, p, pend, ntok, (int)nnew, mq, cwv, s_aexp, warp, lane);
        __syncthreads();
        if constexpr (TILE_WORDS) tile_from_words(w, s);
        const float* sbeta = reinterpret_cast<const float*>(dsm + L.sbeta);
        const kda_u32 elem0 = (kda_u32)hv * (kda_u32)(K * V);
        // The pending entries, then a commit's store (with a ring the plan stores after the
        // pending entries or not at all; with none pending the state is unchanged), then the
        // new tokens with their read-outs: two loops, so neither tests per token which kind of
        // token it steps.
        float o[TV];
        for (int t = 0; t < pend; ++t)
            token_step<true>(s, ka + t * KS, da + t * KS, qa, va + t * RCW + col0l, cwv - col0l, sbeta[t], lk, false,
                             o);
        if (pl.store_after == (kda_u32)pend && pend > 0 && col0l < cwv)
            store_tile<false, true>(head, lk, col0, s, 0u, elem0);
        for (int t = pend; t < ntok; ++t) {
            token_step<true>(s, ka + t * KS, da + t * KS, qa + (t - pend) * KS, va + t * RCW + col0l, cwv - col0l,
                             sbeta[t], lk, true, o);
            if (lk == 0 && col0l < cwv) {
                const size_t tok = bos + (size_t)(t - pend);
                store_out(reinterpret_cast<IT*>(p.out) + (tok * p.hv + hv) * V + col0, o, col0);
            }
        }
        if (!store && pl.append_at != KDA_NONE && nnew > 0)
            tile_append(dsm, L, p, slot, pl.append_at, bos, nnew, h, hv, group, cb, cwv, gran, entry);
    }
    tile_settle(p, pl, old, per_seq, store, meta, slot, bos, nnew, s_last);
}
