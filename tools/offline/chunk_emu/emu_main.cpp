// The chunked prefill's kernels (kda_chunk_prep, kda_chunk_state) run on the CPU through
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
static std::vector<Win> windows(const std::vector<size_t>& bounds, size_t max_chunks) {
    std::vector<Win> out;
    Win cur;
    for (size_t seq = 0; seq + 1 < bounds.size(); ++seq) {
        const size_t start = bounds[seq], end = bounds[seq + 1];
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
    if (!cur.chunks.empty()) out.push_back(cur);
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
    int h = 2, hv = 4, slots_total = 13;
    std::vector<size_t> lens{150, 1, 0, 37, 64, 130};
    std::vector<u32> slots{1, 3, 5, 7, 9, 12};
    std::vector<size_t> bounds;
    size_t tokens = 0;
    std::vector<IT> q, k, v, g, beta, out;
    std::vector<float> a_log, dt_bias;
    std::vector<ST> ssm;
};

static Problem make_problem(uint64_t seed) {
    Problem pb;
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
    p.bounds = (kda_u64)bounds32.data();
    p.slots = (kda_u64)pb.slots.data();
    p.n_seqs = (u32)pb.lens.size();
    p.h = (u32)pb.h;
    p.hv = (u32)pb.hv;
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

// The backend's chunked prefill: per window kda_chunk_prep over its chunks, then
// kda_chunk_state over its pieces, on poisoned scratch.
static void run_chunked(Problem& pb, size_t max_chunks) {
    std::vector<u32> bounds32(pb.bounds.begin(), pb.bounds.end());
    const KdaParams p = params_of(pb, bounds32);
    const auto wins = windows(pb.bounds, max_chunks);
    size_t most = 0;
    for (const auto& w : wins) most = std::max(most, w.chunks.size());
    const size_t blocks = most * pb.hv, bt = kda::BT;
    // the regions of chunk_plan.rs's ScratchLayout, poisoned
    std::vector<float> w(blocks * bt * K), qg(w.size()), kg(w.size()), u(blocks * bt * V),
        aqk(blocks * bt * bt), gl(blocks * K), carry((size_t)pb.hv * K * V);
    for (auto* x : {&w, &qg, &kg, &u, &aqk, &gl, &carry}) std::fill(x->begin(), x->end(), NAN);
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
        c.carry = (kda_u64)carry.data();
        c.n_chunks = (u32)win.chunks.size();
        c.n_pieces = (u32)win.pieces.size();
        auto fresh_smem = [] { std::fill(std::begin(csm), std::end(csm), NAN); };
        emu_launch((u32)(win.chunks.size() * pb.hv), kda::PREP_THREADS, [&] { kda_chunk_prep(p, c); }, fresh_smem);
        constexpr u32 VB = (V + kda::BV - 1) / kda::BV;
        emu_launch((u32)(win.pieces.size() * pb.hv) * VB, kda::STATE_THREADS, [&] { kda_chunk_state(p, c); },
                   fresh_smem);
    }
}

// Spec section 2 in float64 from the (element-typed) inputs and initial states of `pb`.
static void reference(const Problem& pb, std::vector<double>& out, std::vector<double>& states) {
    out.assign(pb.tokens * pb.hv * V, 0.0);
    states.assign(pb.lens.size() * pb.hv * K * V, 0.0);
    const double scale = 1.0 / std::sqrt((double)K);
    const int group = pb.hv / pb.h;
    for (size_t n = 0; n < pb.lens.size(); ++n) {
        for (int hv = 0; hv < pb.hv; ++hv) {
            const int h = hv / group;
            std::vector<double> S((size_t)K * V);
            const ST* head = pb.ssm.data() + ((size_t)pb.slots[n] * pb.hv + hv) * K * V;
            for (int kk = 0; kk < K; ++kk)
                for (int c = 0; c < V; ++c) S[(size_t)kk * V + c] = up(head[VFIRST ? c * K + kk : kk * V + c]);
            for (size_t t = pb.bounds[n]; t < pb.bounds[n + 1]; ++t) {
                std::vector<double> q(K), k(K), d(K), vv(V), uu(V, 0.0);
                double nq = 0, nk = 0;
                for (int kk = 0; kk < K; ++kk) {
                    q[kk] = up(pb.q[(t * pb.h + h) * K + kk]);
                    k[kk] = up(pb.k[(t * pb.h + h) * K + kk]);
                    nq += q[kk] * q[kk];
                    nk += k[kk] * k[kk];
                    const double z = (double)up(pb.g[(t * pb.hv + hv) * K + kk]) + pb.dt_bias[(size_t)hv * K + kk];
                    const double sp = z > 20.0 ? z : std::log1p(std::exp(z));
                    d[kk] = std::exp(-std::exp((double)pb.a_log[hv]) * sp);
                }
                for (int kk = 0; kk < K; ++kk) {
                    q[kk] = q[kk] / std::sqrt(nq + 1e-6) * scale;
                    k[kk] = k[kk] / std::sqrt(nk + 1e-6);
                }
                const double b = 1.0 / (1.0 + std::exp(-(double)up(pb.beta[t * pb.hv + hv])));
                for (int c = 0; c < V; ++c) vv[c] = up(pb.v[(t * pb.hv + hv) * V + c]);
                for (int kk = 0; kk < K; ++kk)
                    for (int c = 0; c < V; ++c) S[(size_t)kk * V + c] *= d[kk];
                for (int c = 0; c < V; ++c) {
                    double ks = 0;
                    for (int kk = 0; kk < K; ++kk) ks += k[kk] * S[(size_t)kk * V + c];
                    uu[c] = b * (vv[c] - ks);
                }
                for (int kk = 0; kk < K; ++kk)
                    for (int c = 0; c < V; ++c) S[(size_t)kk * V + c] += k[kk] * uu[c];
                for (int c = 0; c < V; ++c) {
                    double o = 0;
                    for (int kk = 0; kk < K; ++kk) o += q[kk] * S[(size_t)kk * V + c];
                    out[(t * pb.hv + hv) * V + c] = o;
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

int main() {
    int fails = 0;
    const bool st_bf16 = std::is_same<ST, kda_bf16>::value, it_bf16 = std::is_same<IT, kda_bf16>::value;
    const double tol_out = 1e-5 + 1.01 * unit_roundoff((int)sizeof(IT), it_bf16);
    const double tol_state = 1e-5 + (EMU_SR ? 2.02 : 1.01) * unit_roundoff((int)sizeof(ST), st_bf16);
    Problem whole = make_problem(77), windowed = make_problem(77);
    std::vector<double> ref_out, ref_states;
    reference(whole, ref_out, ref_states);
    run_chunked(whole, 1 << 20);
    run_chunked(windowed, 1);
    std::vector<double> out;
    bool out_poisoned = false;
    for (size_t t = 0; t < whole.tokens; ++t)
        for (size_t e = 0; e < (size_t)whole.hv * V; ++e) {
            const float x = up(whole.out[t * whole.hv * V + e]);
            out_poisoned |= !std::isfinite(x);
            out.push_back(x);
        }
    const double eo = rel(out, ref_out), es = rel(states_of(whole), ref_states);
    std::printf("outputs: relative error %.3e (tolerance %.3e)%s\n", eo, tol_out, out_poisoned ? ", NOT ALL WRITTEN" : "");
    std::printf("states: relative error %.3e (tolerance %.3e)\n", es, tol_state);
    fails += out_poisoned || !(eo <= tol_out) || !(es <= tol_state);
    const bool same_out = std::memcmp(whole.out.data(), windowed.out.data(), whole.out.size() * sizeof(IT)) == 0;
    const bool same_ssm = std::memcmp(whole.ssm.data(), windowed.ssm.data(), whole.ssm.size() * sizeof(ST)) == 0;
    std::printf("windows of one chunk: outputs %s, states %s\n", same_out ? "same bits" : "DIFFERENT",
                same_ssm ? "same bits" : "DIFFERENT");
    fails += !same_out || !same_ssm;
    // the slots of no sequence keep their bits
    Problem fresh = make_problem(77);
    size_t touched = 0;
    for (int s = 0; s < fresh.slots_total; ++s) {
        if (std::find(fresh.slots.begin(), fresh.slots.end(), (u32)s) != fresh.slots.end()) continue;
        const size_t n = (size_t)fresh.hv * K * V, at = (size_t)s * n;
        touched += std::memcmp(fresh.ssm.data() + at, whole.ssm.data() + at, n * sizeof(ST)) != 0;
    }
    // and the empty sequence's slot too
    {
        const size_t n = (size_t)fresh.hv * K * V, at = (size_t)fresh.slots[2] * n;
        touched += std::memcmp(fresh.ssm.data() + at, whole.ssm.data() + at, n * sizeof(ST)) != 0;
    }
    std::printf("slots outside the call and of the empty sequence: %s\n", touched ? "CHANGED" : "unchanged");
    fails += touched != 0;
    std::printf("%s\n", fails ? "FAIL" : "ok");
    return fails ? 1 : 0;
}
