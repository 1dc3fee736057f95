// The chunked prefill's kernels (kda_chunk_prep, kda_chunk_state, kda_chunk_out) run on the CPU through
// emu_shim.h, against a float64 token-by-token recurrence (spec section 2) of the same
// inputs: fresh random inputs and states, outputs and scratch poisoned first, GVA, the
// softplus gate, sigmoid beta and q/k l2norm in the kernel, sequences of several chunks, of
// one token and of none, in windows of every chunk at once and of one chunk (the state carried
// in f32 from window to window, which must change no bit). Appended to one translation unit by
// chunk_emu.sh after the kernel sources, with the specialisation's defines (KDA_ST, KDA_IT,
// KDA_VFIRST, KDA_K, KDA_V) and EMU_SR (1: stochastic rounding of the stored state).
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <random>

using u32 = unsigned;

// chunk_plan.rs's `windows`, as the backend packs a call.
struct Win {
    std::vector<std::array<u32, 2>> chunks;
    std::vector<std::array<u32, 4>> pieces;
};
static std::vector<Win> windows(const std::vector<size_t>& bounds, size_t max_chunks, bool keep_empty) {
    std::vector<Win> out;
    Win cur;
    for (size_t seq = 0; seq + 1 < bounds.size(); ++seq) {
        const size_t start = bounds[seq], end = bounds[seq + 1];
        if (start == end && keep_empty)
            cur.pieces.push_back({(u32)cur.chunks.size(), 0u, (u32)seq, KDA_PIECE_FROM_SLOT | KDA_PIECE_TO_SLOT});
        size_t tok = start;
        while (tok < end) {
            if (cur.chunks.size() == max_chunks) {
                out.push_back(cur);
                cur = Win();
            }
            const u32 first = (u32)cur.chunks.size();
            const u32 from = tok == start ? KDA_PIECE_FROM_SLOT : 0u;
            u32 n = 0;
            while (tok < end && cur.chunks.size() < max_chunks) {
                const size_t len = std::min(end - tok, (size_t)kda::BT);
                cur.chunks.push_back({(u32)tok, (u32)len});
                tok += len;
                ++n;
            }
            const u32 to = tok == end ? KDA_PIECE_TO_SLOT : 0u;
            cur.pieces.push_back({first, n, (u32)seq, from | to});
        }
    }
    if (!cur.pieces.empty()) out.push_back(cur);
    return out;
}

template <typename T> static T from_f32(float x) { return KdaElem<T>::from_f32(x); }
template <typename T> static float up(T x) { return kda_load(x); }
template <typename T> static T poison() {
    T x;
    std::memset(&x, 0xff, sizeof(T)); // NaN in every element type
    return x;
}

struct Problem {
    int h = 2, hv = 4, slots_total = 13, ring_len = 0;
    std::vector<size_t> lens{150, 1, 0, 37, 64, 130};
    std::vector<u32> slots{1, 3, 5, 7, 9, 12};
    std::vector<size_t> bounds;
    size_t tokens = 0;
    std::vector<IT> q, k, v, g, beta, out, ring;
    std::vector<float> a_log, dt_bias;
    std::vector<ST> ssm;
    std::vector<u32> meta, err{0u, KDA_NONE, 0u, 0u};
    size_t entry = 0; // elements of one ring entry
};

// A problem of fresh random inputs and states; with `ring_len`, each slot of the call holds a
// ring record of 0..ring_len entries of random raw inputs, the last of them a draft (which a
// prefill drops), the others pending (which it folds first).
static Problem make_problem(uint64_t seed, int ring_len) {
    Problem pb;
    pb.ring_len = ring_len;
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_real_distribution<float> ud(-2.0f, 0.5f);
    pb.bounds.push_back(0);
    for (size_t l : pb.lens) pb.bounds.push_back(pb.bounds.back() + l);
    pb.tokens = pb.bounds.back();
    auto fill = [&](std::vector<IT>& x, size_t n, float s) {
        x.resize(n);
        for (auto& e : x) e = from_f32<IT>(s * nd(rng));
    };
    fill(pb.q, pb.tokens * pb.h * K, 1.0f);
    fill(pb.k, pb.tokens * pb.h * K, 1.0f);
    fill(pb.v, pb.tokens * pb.hv * V, 1.0f);
    fill(pb.g, pb.tokens * pb.hv * K, 1.0f);
    fill(pb.beta, pb.tokens * pb.hv, 1.0f);
    pb.a_log.resize(pb.hv);
    for (auto& e : pb.a_log) e = ud(rng);
    pb.dt_bias.resize((size_t)pb.hv * K);
    for (auto& e : pb.dt_bias) e = 0.5f * nd(rng);
    pb.ssm.resize((size_t)pb.slots_total * pb.hv * K * V);
    for (auto& e : pb.ssm) e = from_f32<ST>(0.5f * nd(rng));
    pb.out.assign(pb.tokens * pb.hv * V, poison<IT>());
    pb.entry = (size_t)pb.h * K + (size_t)pb.hv * V + (size_t)pb.hv * K + pb.hv;
    pb.meta.assign((size_t)pb.slots_total * 4, 0u);
    if (ring_len > 0) {
        fill(pb.ring, (size_t)pb.slots_total * ring_len * pb.entry, 1.0f);
        for (size_t n = 0; n < pb.slots.size(); ++n) {
            const u32 len = (u32)((n * 2 + 3) % (ring_len + 1)); // the empty sequence 2: 2 pending
            u32* m = pb.meta.data() + 4 * pb.slots[n];
            m[0] = len;
            m[1] = len > 0 ? len - 1 : 0;
        }
    }
    return pb;
}

static KdaParams params_of(Problem& pb, const std::vector<u32>& bounds32) {
    KdaParams p{};
    p.q = (kda_u64)pb.q.data();
    p.k = (kda_u64)pb.k.data();
    p.v = (kda_u64)pb.v.data();
    p.g = (kda_u64)pb.g.data();
    p.beta = (kda_u64)pb.beta.data();
    p.a_log = (kda_u64)pb.a_log.data();
    p.dt_bias = (kda_u64)pb.dt_bias.data();
    p.out = (kda_u64)pb.out.data();
    p.ssm = (kda_u64)pb.ssm.data();
    p.ring = (kda_u64)pb.ring.data();
    p.meta = (kda_u64)pb.meta.data();
    p.err = (kda_u64)pb.err.data();
    p.bounds = (kda_u64)bounds32.data();
    p.slots = (kda_u64)pb.slots.data();
    p.n_seqs = (u32)pb.lens.size();
    p.h = (u32)pb.h;
    p.hv = (u32)pb.hv;
    p.ring_len = (u32)pb.ring_len;
    p.op = KDA_OP_PREFILL;
    p.gate_mode = 1;
    p.beta_sigmoid = 1;
    p.l2norm = 1;
    p.scale = 1.0f / std::sqrt((float)K);
    p.beta_factor = 1.0f;
    p.sr = EMU_SR;
    p.seed_lo = 12345;
    p.seed_hi = 678;
    p.layer = 2;
    p.epoch = 9;
    return p;
}

// params.rs's FastDiv.
static KdaDiv fast_div(u32 d) {
    const uint64_t dd = d > 0 ? d : 1;
    const u32 s = dd == 1 ? 0 : 64 - __builtin_clzll(dd - 1);
    return KdaDiv{(u32)(((uint64_t)1 << 32) * (((uint64_t)1 << s) - dd) / dd + 1), s};
}

// The backend's kda_step launch of a prefill (token by token), over `bounds32`: on an eager pool
// a value head per CTA unit, min(warps per head, 4) warps; with a ring a q/k head and its value
// heads per CTA, min(warps per head, 8) warps (backend.rs, `launch` and `step_warps`).
static void run_steps(Problem& pb, const std::vector<u32>& bounds32) {
    KdaParams p = params_of(pb, bounds32);
    const u32 wph = (V + kda::WC - 1) / kda::WC;
    u32 units, hpc, vblocks, warps;
    if (pb.ring_len > 0) {
        units = pb.h, hpc = pb.hv / pb.h, vblocks = 1, warps = std::min(wph, 8u);
    } else {
        warps = std::min(wph, 4u);
        units = pb.hv, hpc = 1, vblocks = (wph + warps - 1) / warps;
    }
    p.units = units;
    p.heads_per_cta = hpc;
    p.vblocks = vblocks;
    p.div_seq = fast_div(units * vblocks);
    p.div_vb = fast_div(vblocks);
    p.div_grp = fast_div(pb.hv / pb.h);
    emu_launch((u32)pb.lens.size() * units * vblocks, warps * 32, [&] { kda_step(p); }, [] {});
}

// The backend's chunked prefill: per window kda_chunk_prep over its chunks, kda_chunk_state
// (or, `narrow`, kda_chunk_state_narrow) over its pieces (which folds a ring's pending entries
// first) and kda_chunk_out over its chunks, on poisoned scratch; with a ring then
// kda_chunk_ring_reset.
static void run_chunked(Problem& pb, size_t max_chunks, bool narrow = false) {
    std::vector<u32> bounds32(pb.bounds.begin(), pb.bounds.end());
    const KdaParams p = params_of(pb, bounds32);
    const auto wins = windows(pb.bounds, max_chunks, pb.ring_len > 0);
    size_t most = 0;
    for (const auto& w : wins) most = std::max(most, w.chunks.size());
    const size_t blocks = most * pb.hv, bt = kda::BT;
    // the regions of chunk_plan.rs's ScratchLayout, poisoned
    std::vector<float> w(blocks * bt * kda::SK), qg(blocks * bt * K), kg(w.size()), u(blocks * bt * V),
        aqk(blocks * bt * bt), gl(blocks * K), hs(blocks * K * V), carry((size_t)pb.hv * K * V);
    for (auto* x : {&w, &qg, &kg, &u, &aqk, &gl, &hs, &carry}) std::fill(x->begin(), x->end(), NAN);
    for (const auto& win : wins) {
        std::vector<u32> ch, pc;
        for (const auto& c : win.chunks) ch.insert(ch.end(), c.begin(), c.end());
        for (const auto& c : win.pieces) pc.insert(pc.end(), c.begin(), c.end());
        KdaChunkParams c{};
        c.chunks = (kda_u64)ch.data();
        c.pieces = (kda_u64)pc.data();
        c.w = (kda_u64)w.data();
        c.qg = (kda_u64)qg.data();
        c.kg = (kda_u64)kg.data();
        c.u = (kda_u64)u.data();
        c.aqk = (kda_u64)aqk.data();
        c.gl = (kda_u64)gl.data();
        c.hs = (kda_u64)hs.data();
        c.carry = (kda_u64)carry.data();
        c.prep_items = win.chunks.size() * pb.hv;
        auto fresh_smem = [] { std::fill(std::begin(csm), std::end(csm), NAN); };
        // kda_chunk_prep on three persistent CTAs (the backend's one per SM, where inputs are
        // staged; its loop is the same for unstaged ones), so that most take several items
        const u32 prep_ctas = std::min<u32>((u32)c.prep_items, 3);
        emu_launch(prep_ctas, kda::PREP_THREADS, [&] { kda_chunk_prep(p, c); }, fresh_smem);
        const u32 bv = narrow ? kda::BVN : kda::BV, vb = (V + bv - 1) / bv;
        emu_launch((u32)(win.pieces.size() * pb.hv) * vb, kda::STATE_THREADS, [&] {
            if (narrow)
                kda_chunk_state_narrow(p, c);
            else
                kda_chunk_state(p, c);
        }, fresh_smem);
        constexpr u32 OVB = (V + kda::OBV - 1) / kda::OBV;
        emu_launch((u32)(win.chunks.size() * pb.hv) * OVB, kda::OUT_THREADS, [&] { kda_chunk_out(p, c); },
                   fresh_smem);
    }
    if (pb.ring_len > 0)
        emu_launch((u32)(pb.lens.size() + 127) / 128, 128, [&] { kda_chunk_ring_reset(p); }, [] {});
}

// One token's raw inputs for the reference: the rows of its q/k head and value head.
struct Tok {
    const IT *q, *k, *v, *g, *beta;
    double* out; // [V], or null (a ring entry: no output)
};

// Spec section 2 in float64 from the (element-typed) inputs and initial states of `pb`: each
// sequence's pending ring entries (drafts dropped), then its tokens.
static void reference(const Problem& pb, std::vector<double>& out, std::vector<double>& states) {
    out.assign(pb.tokens * pb.hv * V, 0.0);
    states.assign(pb.lens.size() * pb.hv * K * V, 0.0);
    const double scale = 1.0 / std::sqrt((double)K);
    const int group = pb.hv / pb.h;
    for (size_t n = 0; n < pb.lens.size(); ++n) {
        for (int hv = 0; hv < pb.hv; ++hv) {
            const int h = hv / group;
            std::vector<Tok> toks;
            if (pb.ring_len > 0) {
                const u32 pending = pb.meta[4 * pb.slots[n] + 1];
                for (u32 e = 0; e < pending; ++e) {
                    const IT* base = pb.ring.data() + ((size_t)pb.slots[n] * pb.ring_len + e) * pb.entry;
                    toks.push_back({nullptr, base + (size_t)h * K, base + (size_t)pb.h * K + (size_t)hv * V,
                                    base + (size_t)pb.h * K + (size_t)pb.hv * V + (size_t)hv * K,
                                    base + (size_t)pb.h * K + (size_t)pb.hv * V + (size_t)pb.hv * K + hv, nullptr});
                }
            }
            for (size_t t = pb.bounds[n]; t < pb.bounds[n + 1]; ++t)
                toks.push_back({pb.q.data() + (t * pb.h + h) * K, pb.k.data() + (t * pb.h + h) * K,
                                pb.v.data() + (t * pb.hv + hv) * V, pb.g.data() + (t * pb.hv + hv) * K,
                                pb.beta.data() + t * pb.hv + hv, out.data() + (t * pb.hv + hv) * V});
            std::vector<double> S((size_t)K * V);
            const ST* head = pb.ssm.data() + ((size_t)pb.slots[n] * pb.hv + hv) * K * V;
            for (int kk = 0; kk < K; ++kk)
                for (int c = 0; c < V; ++c) S[(size_t)kk * V + c] = up(head[VFIRST ? c * K + kk : kk * V + c]);
            for (const Tok& tk : toks) {
                std::vector<double> q(K, 0.0), k(K), d(K), vv(V), uu(V, 0.0);
                double nq = 0, nk = 0;
                for (int kk = 0; kk < K; ++kk) {
                    if (tk.q) q[kk] = up(tk.q[kk]);
                    k[kk] = up(tk.k[kk]);
                    nq += q[kk] * q[kk];
                    nk += k[kk] * k[kk];
                    const double z = (double)up(tk.g[kk]) + pb.dt_bias[(size_t)hv * K + kk];
                    const double sp = z > 20.0 ? z : std::log1p(std::exp(z));
                    d[kk] = std::exp(-std::exp((double)pb.a_log[hv]) * sp);
                }
                for (int kk = 0; kk < K; ++kk) {
                    q[kk] = q[kk] / std::sqrt(nq + 1e-6) * scale;
                    k[kk] = k[kk] / std::sqrt(nk + 1e-6);
                }
                const double b = 1.0 / (1.0 + std::exp(-(double)up(tk.beta[0])));
                for (int c = 0; c < V; ++c) vv[c] = up(tk.v[c]);
                for (int kk = 0; kk < K; ++kk)
                    for (int c = 0; c < V; ++c) S[(size_t)kk * V + c] *= d[kk];
                for (int c = 0; c < V; ++c) {
                    double ks = 0;
                    for (int kk = 0; kk < K; ++kk) ks += k[kk] * S[(size_t)kk * V + c];
                    uu[c] = b * (vv[c] - ks);
                }
                for (int kk = 0; kk < K; ++kk)
                    for (int c = 0; c < V; ++c) S[(size_t)kk * V + c] += k[kk] * uu[c];
                if (tk.out)
                    for (int c = 0; c < V; ++c) {
                        double o = 0;
                        for (int kk = 0; kk < K; ++kk) o += q[kk] * S[(size_t)kk * V + c];
                        tk.out[c] = o;
                    }
            }
            std::copy(S.begin(), S.end(), states.begin() + (n * pb.hv + hv) * (size_t)K * V);
        }
    }
}

static double rel(const std::vector<double>& got, const std::vector<double>& want) {
    double d = 0, w = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        d += (got[i] - want[i]) * (got[i] - want[i]);
        w += want[i] * want[i];
    }
    return std::sqrt(d / std::max(w, 1e-300));
}

static std::vector<double> states_of(const Problem& pb) {
    std::vector<double> s;
    for (size_t n = 0; n < pb.lens.size(); ++n)
        for (int hv = 0; hv < pb.hv; ++hv) {
            const ST* head = pb.ssm.data() + ((size_t)pb.slots[n] * pb.hv + hv) * K * V;
            for (int kk = 0; kk < K; ++kk)
                for (int c = 0; c < V; ++c) s.push_back(up(head[VFIRST ? c * K + kk : kk * V + c]));
        }
    return s;
}

static double unit_roundoff(int bytes, bool bf16) { return bytes == 4 ? 0x1p-24 : bf16 ? 0x1p-8 : 0x1p-11; }

// Checks one prefill of `got` (run from the problem `fresh` was made as) against the reference:
// outputs all written and within tolerance, states within tolerance (the empty sequence's
// too: with a ring its pending entries folded), rings left empty, the slots outside the call
// unchanged (and the empty sequence's without a ring). Returns the failures.
static int check(const char* what, const Problem& got, const Problem& fresh, const std::vector<double>& ref_out,
                 const std::vector<double>& ref_states, double tol_out, double tol_state) {
    int fails = 0;
    std::vector<double> out;
    bool out_poisoned = false;
    for (size_t e = 0; e < got.out.size(); ++e) {
        const float x = up(got.out[e]);
        out_poisoned |= !std::isfinite(x);
        out.push_back(x);
    }
    const double eo = rel(out, ref_out), es = rel(states_of(got), ref_states);
    std::printf("%s: outputs %.3e (tolerance %.3e)%s, states %.3e (tolerance %.3e)\n", what, eo, tol_out,
                out_poisoned ? ", NOT ALL WRITTEN" : "", es, tol_state);
    fails += out_poisoned || !(eo <= tol_out) || !(es <= tol_state);
    size_t touched = 0, rings = 0;
    const size_t n = (size_t)fresh.hv * K * V;
    for (int s = 0; s < fresh.slots_total; ++s) {
        const bool in_call = std::find(fresh.slots.begin(), fresh.slots.end(), (u32)s) != fresh.slots.end();
        // (the empty sequence's slot too, where it has no ring to fold)
        if (in_call && (s != (int)fresh.slots[2] || fresh.ring_len > 0)) continue;
        touched += std::memcmp(fresh.ssm.data() + s * n, got.ssm.data() + s * n, n * sizeof(ST)) != 0;
    }
    for (u32 s : fresh.slots) rings += got.meta[4 * s] != 0 || got.meta[4 * s + 1] != 0;
    if (touched || rings) std::printf("%s: %zu other slots CHANGED, %zu rings NOT EMPTY\n", what, touched, rings);
    return fails + (touched != 0) + (rings != 0);
}

int main() {
    int fails = 0;
    const bool st_bf16 = std::is_same<ST, kda_bf16>::value, it_bf16 = std::is_same<IT, kda_bf16>::value;
    const double tol_out = 1e-5 + 1.01 * unit_roundoff((int)sizeof(IT), it_bf16);
    const double tol_state = 1e-5 + (EMU_SR ? 2.02 : 1.01) * unit_roundoff((int)sizeof(ST), st_bf16);
    for (int ring_len : {0, 3}) {
        std::printf("-- ring %d\n", ring_len);
        const Problem fresh = make_problem(77 + ring_len, ring_len);
        std::vector<double> ref_out, ref_states;
        reference(fresh, ref_out, ref_states);
        Problem whole = fresh, windowed = fresh, steps = fresh, narrow = fresh;
        run_chunked(whole, 1 << 20);
        run_chunked(windowed, 1);
        run_chunked(narrow, 1 << 20, true);
        run_steps(steps, std::vector<u32>(steps.bounds.begin(), steps.bounds.end()));
        fails += check("chunked", whole, fresh, ref_out, ref_states, tol_out, tol_state);
        fails += check("token by token (kda_step)", steps, fresh, ref_out, ref_states, tol_out, tol_state);
        const bool same_out = std::memcmp(whole.out.data(), windowed.out.data(), whole.out.size() * sizeof(IT)) == 0;
        const bool same_ssm = std::memcmp(whole.ssm.data(), windowed.ssm.data(), whole.ssm.size() * sizeof(ST)) == 0;
        std::printf("chunked in windows of one chunk: outputs %s, states %s\n", same_out ? "same bits" : "DIFFERENT",
                    same_ssm ? "same bits" : "DIFFERENT");
        fails += !same_out || !same_ssm;
        const bool n_out = std::memcmp(whole.out.data(), narrow.out.data(), whole.out.size() * sizeof(IT)) == 0;
        const bool n_ssm = std::memcmp(whole.ssm.data(), narrow.ssm.data(), whole.ssm.size() * sizeof(ST)) == 0;
        std::printf("chunked in %d columns per state CTA: outputs %s, states %s\n", kda::BVN,
                    n_out ? "same bits" : "DIFFERENT", n_ssm ? "same bits" : "DIFFERENT");
        fails += !n_out || !n_ssm;
        const bool err_clean = steps.err[0] == 0 && whole.err[0] == 0;
        if (!err_clean) std::printf("error word set: %u %u\n", steps.err[0], whole.err[0]);
        fails += !err_clean;
    }
    std::printf("%s\n", fails ? "FAIL" : "ok");
    return fails ? 1 : 0;
}
