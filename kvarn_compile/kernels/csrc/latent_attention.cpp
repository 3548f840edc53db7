// kvarn::latent_attention on CPU (kernels/cpu/attention.py: latent_attention_state is its
// launcher): multi-head latent attention in its absorbed form over a latent state, whose keys
// are the normed latent (D = kv_lora_rank) and whose values are the shared RoPE key (DV):
//
//     out = softmax(scale * (q . latent^T + q_pe . rope^T) + mask) . latent      [B, HQ, TQ, D]
//
// One packed copy of the latent serves both sides: a key tile is dequantized once per task
// into an fp32 block that gives the scores and (read as values) the output, the value tile
// of the same tokens gives the RoPE part of the scores. The structure is the multi-query path
// of attention.cpp (run_chunk): a task is one range of units (the sink, one tile, the tail)
// of one (batch row, kv head, block of queries); each unit becomes one fp32 block
// KV [D + DV, n] (channels x tokens; rows < D the latent, the rest the RoPE key) and every
// query row of the task goes through it with two register-blocked GEMMs (scores = Q KV,
// out^T += KV[:D] P^T) and one online softmax per row. Tiles are scored with the rotated
// [q | q_pe] (or [q | rotated q_pe] for a key tile stored un-rotated, k_plain) and add to a
// rotated-frame accumulator (plain tiles: the un-rotated one), the exact region with the
// un-rotated [q | q_pe] to the un-rotated one; the ranges of units are merged by log-sum-exp
// and the rotated part rotated back once per query row. Visibility (rows of different
// lengths, causal, sliding window, bool or additive masks by absolute key position) is per
// element, so the result is the reference's (ops/attention.py: latent_attention) wherever
// it runs. Scales in fp16 / bf16 / fp32, or fp8 (e4m3fn) with their fp16 per-vector factors.
// Built with attention.cpp (which binds kvarn_latent_attention_state) by kernels/cpu/build.py.
#include "kvarn_common.h"
#include "attention_common.h"   // vectors, vexp, dtype conversion, unpacking, softmax_step

#include <c10/util/Float8_e4m3fn.h>

#include <array>
#include <limits>
#include <memory>
#include <sstream>

namespace {

// ---------------------------------------------------------------- GEMM micro-kernels
// Native lanes: one zmm with AVX-512, one ymm otherwise (GCC spills 16-lane vectors there).
#if defined(__AVX512F__)
typedef float vl_t __attribute__((vector_size(64)));
constexpr int VL = 16;
constexpr int LMR = 8;     // rows per block: 16 accumulators (2 vectors a row), 32 registers
inline vl_t lsplat(float x) { return vl_t{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
typedef float vl_t __attribute__((vector_size(32)));
constexpr int VL = 8;
constexpr int LMR = 6;     // 12 accumulators + 2 loads + 1 broadcast of 16 ymm registers
inline vl_t lsplat(float x) { return vl_t{x, x, x, x, x, x, x, x}; }
#endif
inline vl_t lld(const float* p) { vl_t v; std::memcpy(&v, p, sizeof v); return v; }
inline void lst(float* p, vl_t v) { std::memcpy(p, &v, sizeof v); }

// Y[r][j] = init + sum_k X[r * ldx + k] * M[k * ldm + j] for r < NR and the NV * VL columns
// from j0. init: 0, or (acc) Y[r][j] itself, times cs[j] when cs is given (the softmax
// rescale of the transposed accumulators, whose columns are query rows).
template <int NR, int NV>
inline void gemm_block(const float* X, int64_t ldx, int K, const float* M, int64_t ldm, int j0,
                       float* Y, int64_t ldy, bool acc, const float* cs) {
  vl_t a[NR][NV];
  for (int v = 0; v < NV; ++v) {
    const vl_t s = cs ? lld(cs + j0 + v * VL) : vl_t{};
    for (int r = 0; r < NR; ++r) {
      if (!acc) { a[r][v] = vl_t{}; continue; }
      a[r][v] = lld(Y + r * ldy + j0 + v * VL);
      if (cs) a[r][v] *= s;
    }
  }
  const float* m = M + j0;
  for (int k = 0; k < K; ++k, m += ldm) {
    vl_t mv[NV];
    for (int v = 0; v < NV; ++v) mv[v] = lld(m + v * VL);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const vl_t x = lsplat(X[r * ldx + k]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) a[r][v] += x * mv[v];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) lst(Y + r * ldy + j0 + v * VL, a[r][v]);
}

template <int NR, int NV>
inline void gemm_rows_at(int nr, const float* X, int64_t ldx, int K, const float* M, int64_t ldm,
                         int j0, float* Y, int64_t ldy, bool acc, const float* cs) {
  if (nr == NR) gemm_block<NR, NV>(X, ldx, K, M, ldm, j0, Y, ldy, acc, cs);
  else if constexpr (NR > 1) gemm_rows_at<NR - 1, NV>(nr, X, ldx, K, M, ldm, j0, Y, ldy, acc, cs);
}

// Y [R, N] (row stride ldy) = init + X [R, K] (ldx) . M [K, N] (ldm); init as gemm_block's.
// Column blocks of 2 * VL, then VL, then a scalar tail (N need not be a multiple of VL).
void gemm(const float* X, int R, int64_t ldx, int K, const float* M, int64_t ldm, int N, float* Y,
          int64_t ldy, bool acc, const float* cs) {
  int j = 0;
  for (; j + 2 * VL <= N; j += 2 * VL)
    for (int r0 = 0; r0 < R; r0 += LMR)
      gemm_rows_at<LMR, 2>(std::min(LMR, R - r0), X + r0 * ldx, ldx, K, M, ldm, j, Y + r0 * ldy, ldy, acc, cs);
  for (; j + VL <= N; j += VL)
    for (int r0 = 0; r0 < R; r0 += LMR)
      gemm_rows_at<LMR, 1>(std::min(LMR, R - r0), X + r0 * ldx, ldx, K, M, ldm, j, Y + r0 * ldy, ldy, acc, cs);
  for (; j < N; ++j)
    for (int r = 0; r < R; ++r) {
      float s = acc ? Y[r * ldy + j] * (cs ? cs[j] : 1.f) : 0.f;
      for (int k = 0; k < K; ++k) s += X[r * ldx + k] * M[k * ldm + j];
      Y[r * ldy + j] = s;
    }
}

// ---------------------------------------------------------------- scales
constexpr int F8 = 3;   // float8_e4m3fn (an fp8 state's scales; their factors are fp16)

const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(c10::Float8_e4m3fn((uint8_t)i, c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

// dst[i] = float(src[off + i]) * factor, i < n (any scale dtype, fp8 included)
void scales(const void* src, int dt, int64_t off, float* dst, int n, float factor) {
  if (dt == F8) {
    const float* t = fp8_table();
    const uint8_t* s = (const uint8_t*)src + off;
    for (int i = 0; i < n; ++i) dst[i] = t[s[i]];
  } else {
    to_float(src, dt, off, dst, n);
  }
  if (factor != 1.f)
    for (int i = 0; i < n; ++i) dst[i] *= factor;
}

// scales() in the loops' code order (to_float_perm's: dst[(t % per) * (n / per) + t / per])
void scales_perm(const void* src, int dt, int64_t off, float* tmp, float* tmp2, float* dst, int n, int per,
                 float factor) {
  scales(src, dt, off, tmp2, n, factor);
  to_float_perm(tmp2, F32, 0, tmp, dst, n, per);
}

// ---------------------------------------------------------------- the call
struct Latent {
  const float *q, *pe, *pe_exact;          // [NQ, D], [NQ, DV] x2 (NQ = B * HQ * TQ rows)
  const float *rot, *rot_t, *rot_pe;       // [D, D], its transpose, [DV, DV]
  const void *sink_k, *sink_v, *tail_k, *tail_v;
  int exact_dt = F32, S = 0, W = 0;
  const uint8_t *kc, *vc;
  const void *krs, *krz, *kcs, *vrs, *vrz, *vcs;
  int scale_dt = F32, zero_dt = F32;
  const void *krf = nullptr, *kcf = nullptr, *vrf = nullptr, *vcf = nullptr;   // fp8 factors
  int factor_dt = F16;
  const int64_t *lengths, *n_tiles;
  const uint8_t* k_plain = nullptr;        // [B, H, N]
  const void* mask = nullptr; int mask_float = 0; int64_t msb = 0, msh = 0, msq = 0, msm = 0;
  int B, H, HQ, TQ, D, DV, N, G, kb, vb;
  float scale; bool causal; int window;
  int task_rows;
  float* out;                              // [B, HQ, TQ, D] fp32
};

constexpr int XB = 64;   // exact-region tokens per block

inline int64_t pad_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void run_latent(const Latent& a) {
  const int B = a.B, H = a.H, HQ = a.HQ, TQ = a.TQ, D = a.D, DV = a.DV, N = a.N, G = a.G;
  const int C = D + DV;                              // score channels: latent, then RoPE key
  const int grp = HQ / H;
  const int64_t NQ = (int64_t)B * HQ * TQ;
  const int QB = std::max(1, std::min(TQ, (a.task_rows + grp - 1) / grp));
  const int nqb = (TQ + QB - 1) / QB;
  const int RM = grp * QB, RPM = (int)pad_to(RM, VL);   // rows of a full task (padded to lanes)
  const int LS = std::max(G, XB);                    // token stride of the blocks
  const int knb_packed = G * a.kb / 8, vnb_packed = DV * a.vb / 8;
  const bool k_native = a.kb == 2 || a.kb == 4 || a.kb == 8;
  const bool v_native = a.vb == 2 || a.vb == 4 || a.vb == 8;
  const int kbits = k_native ? a.kb : 8, vbits = v_native ? a.vb : 8;
  const int kper = 8 / kbits, vper = 8 / vbits;
  const int knb = G / kper, vnb = DV / vper;
  std::vector<int> tok(G), chan(DV);                 // code order -> token of the tile / channel
  for (int i = 0; i < G; ++i) tok[i] = (i % knb) * kper + i / knb;
  for (int i = 0; i < DV; ++i) chan[i] = (i % vnb) * vper + i / vnb;

  // ------------------------------------------------ the rotated queries, once for all tasks
  std::vector<float> qrot((size_t)NQ * D), perot((size_t)NQ * DV);
  at::parallel_for(0, NQ, LMR, [&](int64_t r0, int64_t r1) {
    gemm(a.q + r0 * D, (int)(r1 - r0), D, D, a.rot, D, D, qrot.data() + r0 * D, D, false, nullptr);
    gemm(a.pe + r0 * DV, (int)(r1 - r0), DV, DV, a.rot_pe, DV, DV, perot.data() + r0 * DV, DV, false, nullptr);
  });

  // ------------------------------------------------ where each query row's mask opens up
  // open_all[row]: the mask attends every position < open_all[row] of the row's range (once
  // per call: the tasks of a row's tile ranges share it)
  std::vector<int64_t> open_all(a.mask ? NQ : 0);
  if (a.mask) {
    at::parallel_for(0, NQ, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / ((int64_t)HQ * TQ), qh = i / TQ % HQ, t = i % TQ, len = a.lengths[b];
        const int64_t qpos = len - TQ + t, end = a.causal && qpos < len ? qpos + 1 : len;
        const int64_t off = b * a.msb + qh * a.msh + t * a.msq;
        int64_t p = 0;
        if (a.mask_float) { const float* mf = (const float*)a.mask + off; while (p < end && mf[p * a.msm] == 0.f) ++p; }
        else { const uint8_t* mb = (const uint8_t*)a.mask + off; while (p < end && mb[p * a.msm]) ++p; }
        open_all[i] = p >= end ? std::numeric_limits<int64_t>::max() : p;
      }
    });
  }

  // ------------------------------------------------ tasks: (query block, row, head) x split
  const int64_t BH = (int64_t)B * H, groups = BH * nqb;
  int64_t units = 0;
  for (int b = 0; b < B; ++b) units = std::max<int64_t>(units, std::min<int64_t>(std::max<int64_t>(a.n_tiles[b], 0), N));
  units += 2;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int splits = (int)std::max<int64_t>(1, std::min<int64_t>((8 * threads + groups - 1) / groups, units / 4));
  const int64_t ntasks = groups * splits;
  // (uninitialized: the merge reads a row's partials only where its m is finite, and a task
  // that ran writes all its rows)
  std::unique_ptr<float[]> part_rot(new float[(size_t)ntasks * RM * D]), part_plain(new float[(size_t)ntasks * RM * D]);
  std::vector<float> part_m((size_t)ntasks * RM, NEG_INF), part_l((size_t)ntasks * RM, 0.f);
  std::atomic<int64_t> next{0};
  const int nthreads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, ntasks));
  const bool frames = a.k_plain != nullptr;

  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    std::vector<float> Qr((size_t)RM * C), Qe((size_t)RM * C), Qp(frames ? (size_t)RM * C : 0);
    std::vector<float> Sb((size_t)RM * LS), PT((size_t)LS * RPM), KV((size_t)C * LS);
    std::vector<float> Orot((size_t)D * RPM), Opl((size_t)D * RPM), m(RM), l(RM), frot(RPM), fpl(RPM);
    std::vector<float> ks(D), kz(D), kcs(G), vs(G), vz(G), vcs(DV), row(std::max(D, DV));
    std::vector<float> ctmp(std::max(G, DV)), ctmp2(std::max(G, DV));
    std::vector<uint8_t> k8(k_native ? 0 : (size_t)D * G), v8(v_native ? 0 : (size_t)G * DV);
    std::vector<int64_t> lo(QB), hi(QB), open_end(RM), pos(XB);
    std::vector<int> slot(XB);
    int64_t task;
    while ((task = next.fetch_add(1)) < ntasks) {
      const int64_t g = task / splits;
      const int sp = (int)(task % splits);
      // the last query blocks (the most keys under a causal mask) first
      const int qbi = nqb - 1 - (int)(g / BH);
      const int64_t bh = g % BH;
      const int b = (int)(bh / H), h = (int)(bh % H);
      const int t0 = qbi * QB, qn = std::min(QB, TQ - t0), R = grp * qn, RP = (int)pad_to(R, VL);
      float* pm = part_m.data() + task * RM;
      float* pl = part_l.data() + task * RM;
      const int nt = (int)std::min<int64_t>(std::max<int64_t>(a.n_tiles[b], 0), N);
      const int nunits = nt + 2, per = (nunits + splits - 1) / splits;
      const int u0 = sp * per, u1 = std::min(nunits, u0 + per);
      if (u0 >= u1) continue;                        // (partials stay empty: m = -inf)
      const int64_t len = a.lengths[b];
      // rows r = gi * qn + t: query t0 + t of query head h * grp + gi
      auto qrow = [&](int r) { return ((int64_t)b * HQ + h * grp + r / qn) * TQ + t0 + r % qn; };
      for (int r = 0; r < R; ++r) {   // [q_rot | pe_rot], [q | pe] (exact), [q | pe_rot] (plain tiles)
        const int64_t qr = qrow(r);
        float* xr = Qr.data() + (size_t)r * C;
        float* xe = Qe.data() + (size_t)r * C;
        std::memcpy(xr, qrot.data() + qr * D, sizeof(float) * D);
        std::memcpy(xr + D, perot.data() + qr * DV, sizeof(float) * DV);
        std::memcpy(xe, a.q + qr * D, sizeof(float) * D);
        std::memcpy(xe + D, a.pe_exact + qr * DV, sizeof(float) * DV);
        if (frames) {
          float* xp = Qp.data() + (size_t)r * C;
          std::memcpy(xp, xe, sizeof(float) * D);
          std::memcpy(xp + D, xr + D, sizeof(float) * DV);
        }
      }
      std::fill(Orot.begin(), Orot.begin() + (size_t)D * RP, 0.f);
      std::fill(Opl.begin(), Opl.begin() + (size_t)D * RP, 0.f);
      std::fill(PT.begin(), PT.begin() + (size_t)LS * RP, 0.f);   // (columns >= R stay 0)
      std::fill(m.begin(), m.begin() + R, NEG_INF);
      std::fill(l.begin(), l.begin() + R, 0.f);
      std::fill(frot.begin(), frot.begin() + RP, 1.f);
      std::fill(fpl.begin(), fpl.begin() + RP, 1.f);
      int64_t lo_min = std::numeric_limits<int64_t>::max(), hi_max = std::numeric_limits<int64_t>::min();
      for (int t = 0; t < qn; ++t) {
        const int64_t qpos = len - TQ + t0 + t;
        lo[t] = a.window > 0 ? qpos - a.window + 1 : std::numeric_limits<int64_t>::min();
        hi[t] = a.causal ? qpos : std::numeric_limits<int64_t>::max();
        lo_min = std::min(lo_min, lo[t]);
        hi_max = std::max(hi_max, hi[t]);
      }
      auto mask_off = [&](int r) {
        return b * a.msb + (int64_t)(h * grp + r / qn) * a.msh + (int64_t)(t0 + r % qn) * a.msq;
      };
      for (int r = 0; r < R; ++r) open_end[r] = a.mask ? open_all[qrow(r)] : std::numeric_limits<int64_t>::max();
      auto apply_mask = [&](int r, int64_t p, float x) -> float {
        const int64_t off = mask_off(r) + p * a.msm;
        if (a.mask_float) return x + ((const float*)a.mask)[off];
        return ((const uint8_t*)a.mask)[off] ? x : NEG_INF;
      };
      // One block KV [C, n] (positions p_of(i) for i < cnt, spanning [p0, p1]; columns from
      // cnt on are zero padding): scores with the queries Q (times the softmax scale, as the
      // reference scales them), visibility, the online softmax,
      // then the latent rows read as values into the accumulator `out` (fo: its pending
      // rescale per row, applied as it is read; the other accumulator's factor `fx` takes
      // the rescale on).
      auto block = [&](int n, int cnt, int64_t p0, int64_t p1, auto&& p_of, const float* Q, float* out,
                       float* fo, float* fx) {
        gemm(Q, R, C, C, KV.data(), n, n, Sb.data(), LS, false, nullptr);
        bool live = false;
        for (int r = 0; r < R; ++r) {
          const int t = r % qn;
          float* v = Sb.data() + (size_t)r * LS;
          for (int i = 0; i < n; i += 16) vst(v + i, vld(v + i) * splat(a.scale));
          if (!(p0 >= lo[t] && p1 <= hi[t] && p1 < open_end[r])) {
            for (int i = 0; i < cnt; ++i) {
              const int64_t p = p_of(i);
              if (p < lo[t] || p > hi[t]) v[i] = NEG_INF;
              else if (a.mask && p >= open_end[r]) v[i] = apply_mask(r, p, v[i]);
            }
          }
          for (int i = cnt; i < n; ++i) v[i] = NEG_INF;
          const float al = softmax_step(v, n, m[r], l[r]);
          if (al < 0.f) continue;                      // (v zeroed: the row sees none of it)
          live = true;
          if (al != 1.f) { fo[r] *= al; fx[r] *= al; }
        }
        if (!live) return;
        for (int r = 0; r < R; ++r) {                  // P^T [n, RP]
          const float* v = Sb.data() + (size_t)r * LS;
          for (int i = 0; i < n; ++i) PT[(size_t)i * RP + r] = v[i];
        }
        bool rescale = false;
        for (int r = 0; r < R; ++r) rescale |= fo[r] != 1.f;
        // out^T [D, RP] += KV[:D] [D, n] . P^T [n, RP]
        gemm(KV.data(), D, n, n, PT.data(), RP, RP, out, RP, true, rescale ? fo : nullptr);
        if (rescale) std::fill(fo, fo + R, 1.f);
      };

      for (int u = u0; u < u1; ++u) {
        if (u == 0 || u == nt + 1) {
          // ------------------------------------------------ exact region (sink or tail)
          const bool tail = u != 0;
          const int slots = tail ? a.W : a.S;
          if (!slots) continue;
          const void* kb_ = tail ? a.tail_k : a.sink_k;
          const void* vb_ = tail ? a.tail_v : a.sink_v;
          const int64_t row0 = bh * slots;
          const int64_t base = a.S + (int64_t)a.n_tiles[b] * G;
          // ring slot sl holds position base + (sl - (base - S)) mod W
          int64_t off0 = tail ? (0 - (base - a.S)) % a.W : 0;
          if (off0 < 0) off0 += a.W;
          for (int s0 = 0; s0 < slots; s0 += XB) {
            int64_t pmin, pmax;
            const int cnt = exact_slots(tail, s0, slots, XB, base, off0, a.S, a.W, len, lo_min,
                                        hi_max, pos.data(), slot.data(), pmin, pmax);
            if (!cnt) continue;
            const int n = (cnt + 15) / 16 * 16;
            for (int i = 0; i < cnt; ++i) {   // KV [C, n]: keys [latent | RoPE key], zero padded
              to_float(kb_, a.exact_dt, (row0 + slot[i]) * D, row.data(), D);
              for (int c = 0; c < D; ++c) KV[(size_t)c * n + i] = row[c];
              to_float(vb_, a.exact_dt, (row0 + slot[i]) * DV, row.data(), DV);
              for (int c = 0; c < DV; ++c) KV[(size_t)(D + c) * n + i] = row[c];
            }
            for (int c = 0; c < C; ++c) std::fill(KV.begin() + (size_t)c * n + cnt, KV.begin() + (size_t)c * n + n, 0.f);
            block(n, cnt, pmin, pmax, [&](int i) { return pos[i]; }, Qe.data(), Opl.data(), fpl.data(), frot.data());
          }
          continue;
        }
        // -------------------------------------------------- one packed tile
        const int j = u - 1;
        const int64_t p0 = a.S + (int64_t)j * G, p1 = p0 + G - 1;
        if (p1 < lo_min || p0 > hi_max) continue;
        const int64_t tile = bh * N + j;
        // the latent: K [c][i] = cs[i] * (rs[c] * code + rz[c]) (tokens in the key code order);
        // the RoPE key: V [i][c] = cs[c] * (rs[i] * code + rz[i]), stored transposed below it
        float f_kr = 1.f, f_kc = 1.f, f_vr = 1.f, f_vc = 1.f;
        if (a.krf) {
          to_float(a.krf, a.factor_dt, tile, &f_kr, 1);
          to_float(a.kcf, a.factor_dt, tile, &f_kc, 1);
          to_float(a.vrf, a.factor_dt, tile, &f_vr, 1);
          to_float(a.vcf, a.factor_dt, tile, &f_vc, 1);
        }
        scales(a.krs, a.scale_dt, tile * D, ks.data(), D, f_kr);
        to_float(a.krz, a.zero_dt, tile * D, kz.data(), D);
        scales_perm(a.kcs, a.scale_dt, tile * G, ctmp.data(), ctmp2.data(), kcs.data(), G, kper, f_kc);
        scales_perm(a.vrs, a.scale_dt, tile * G, ctmp.data(), ctmp2.data(), vs.data(), G, kper, f_vr);
        to_float(a.vrz, a.zero_dt, tile * G, ctmp2.data(), G);
        to_float_perm(ctmp2.data(), F32, 0, ctmp.data(), vz.data(), G, kper);
        scales_perm(a.vcs, a.scale_dt, tile * DV, ctmp.data(), ctmp2.data(), vcs.data(), DV, vper, f_vc);
        const uint8_t* kcodes = a.kc + tile * D * knb_packed;
        if (!k_native) { unpack_bytes(kcodes, D, G, a.kb, k8.data()); kcodes = k8.data(); }
        for (int c = 0; c < D; ++c) {
          float* kt = KV.data() + (size_t)c * G;
          row_codes_any(kbits, kcodes + (int64_t)c * knb, knb, kt);
          const float rs = ks[c], rz = kz[c];
          for (int i = 0; i < G; ++i) kt[i] = kcs[i] * (rs * kt[i] + rz);
        }
        const uint8_t* vcodes = a.vc + tile * G * vnb_packed;
        if (!v_native) { unpack_bytes(vcodes, G, DV, a.vb, v8.data()); vcodes = v8.data(); }
        float* kv_pe = KV.data() + (size_t)D * G;
        for (int i = 0; i < G; ++i) {
          row_codes_any(vbits, vcodes + (int64_t)tok[i] * vnb, vnb, row.data());
          const float rs = vs[i], rz = vz[i];
          for (int c = 0; c < DV; ++c) kv_pe[(size_t)chan[c] * G + i] = vcs[c] * (rs * row[c] + rz);
        }
        const bool plain = frames && a.k_plain[tile];
        if (plain)   // scores with the un-rotated q, output not rotated back
          block(G, G, p0, p1, [&](int i) { return p0 + tok[i]; }, Qp.data(), Opl.data(), fpl.data(), frot.data());
        else
          block(G, G, p0, p1, [&](int i) { return p0 + tok[i]; }, Qr.data(), Orot.data(), frot.data(), fpl.data());
      }
      // ------------------------------------------------ this range's partials (rows major)
      float* prot = part_rot.get() + task * RM * D;
      float* ppl = part_plain.get() + task * RM * D;
      for (int r = 0; r < R; ++r) { pm[r] = m[r]; pl[r] = l[r]; }
      for (int c = 0; c < D; ++c) {
        const float* xr = Orot.data() + (size_t)c * RP;
        const float* xp = Opl.data() + (size_t)c * RP;
        for (int r = 0; r < R; ++r) {
          prot[(size_t)r * D + c] = xr[r] * frot[r];
          ppl[(size_t)r * D + c] = xp[r] * fpl[r];
        }
      }
    }
  });

  // ------------------------------------------------ merge the splits, rotate back, write
  // (blocks of up to MB query rows of one group: out = plain / L + (rotated / L) . rot^T)
  constexpr int MB = 8;
  const int64_t blocks_per_group = (RM + MB - 1) / MB;
  at::parallel_for(0, groups * blocks_per_group, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> xr((size_t)MB * D), y((size_t)MB * D);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / blocks_per_group;
      const int qbi = nqb - 1 - (int)(g / BH);
      const int64_t bh = g % BH;
      const int b = (int)(bh / H), h = (int)(bh % H);
      const int t0 = qbi * QB, qn = std::min(QB, TQ - t0), R = grp * qn;
      const int r0 = (int)(item % blocks_per_group) * MB, r1 = std::min(R, r0 + MB);
      if (r0 >= r1) continue;
      int kept[MB], nk = 0;
      for (int r = r0; r < r1; ++r) {
        float* o = a.out + (((int64_t)b * HQ + h * grp + r / qn) * TQ + t0 + r % qn) * D;
        float M = NEG_INF;
        for (int sp = 0; sp < splits; ++sp) M = std::max(M, part_m[(g * splits + sp) * RM + r]);
        if (!(M > NEG_INF)) { std::fill(o, o + D, 0.f); continue; }    // sees no key
        bool poisoned = false;
        for (int sp = 0; sp < splits; ++sp) {
          const int64_t i = (g * splits + sp) * RM + r;
          poisoned |= part_m[i] > NEG_INF && std::isnan(part_l[i]);
        }
        if (poisoned) { std::fill(o, o + D, std::numeric_limits<float>::quiet_NaN()); continue; }
        float* rot = xr.data() + (size_t)nk * D;
        float* pln = y.data() + (size_t)nk * D;
        std::fill(rot, rot + D, 0.f);
        std::fill(pln, pln + D, 0.f);
        float L = 0.f;
        for (int sp = 0; sp < splits; ++sp) {
          const int64_t i = (g * splits + sp) * RM + r;
          if (!(part_m[i] > NEG_INF)) continue;
          const float w = std::exp(part_m[i] - M);
          L += w * part_l[i];
          const float* pr = part_rot.get() + i * D;
          const float* pp = part_plain.get() + i * D;
          for (int c = 0; c < D; ++c) { rot[c] += w * pr[c]; pln[c] += w * pp[c]; }
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int c = 0; c < D; ++c) { rot[c] *= inv; pln[c] *= inv; }
        kept[nk++] = r;
      }
      if (!nk) continue;
      gemm(xr.data(), nk, D, D, a.rot_t, D, D, y.data(), D, true, nullptr);
      for (int k = 0; k < nk; ++k) {
        const int r = kept[k];
        float* o = a.out + (((int64_t)b * HQ + h * grp + r / qn) * TQ + t0 + r % qn) * D;
        std::memcpy(o, y.data() + (size_t)k * D, sizeof(float) * D);
      }
    }
  });
}

std::string py_shape(at::IntArrayRef s) {   // as Python prints a tuple of the sizes
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

}  // namespace

// kvarn::latent_attention from a latent state's flat buffer list (state.py's order: the 16
// base members, the 4 fp8 factors if its scales are fp8, k_plain if it has key frames): the
// reference's checks (queries, RoPE queries, a mask as long as the cache: ValueError), the
// members, bit widths and mask conversion, then the whole attention in one call. Returns the
// output [B, HQ, TQ, D] in q's dtype, or an undefined tensor (None) where this kernel does
// not read the state (other bit widths, storage dtypes or layouts): the caller runs the
// reference. rot / rot_t: the latent's rotation [D, D] and its transpose, rot_pe the RoPE
// key's [DV, DV]; task_rows: about how many query rows (query heads x queries) a task takes.
torch::Tensor kvarn_latent_attention_state(torch::Tensor q, torch::Tensor q_pe, std::vector<torch::Tensor> b,
                                           std::optional<torch::Tensor> mask, torch::Tensor rot,
                                           torch::Tensor rot_t, torch::Tensor rot_pe, double scale,
                                           bool causal, int64_t window, int64_t task_rows) {
  using namespace kvarn;
  const size_t nb = b.size();
  if (nb != N_BASE && nb != N_BASE + 1 && nb != N_BASE + 4 && nb != N_BASE + 5) return {};
  const bool fp8 = nb >= N_BASE + 4, frames = nb == N_BASE + 1 || nb == N_BASE + 5;
  const auto &sink_k = b[SINK_K], &sink_v = b[SINK_V];
  const auto &kc = b[K_CODES], &kcs = b[K_COL_SCALE], &vc = b[V_CODES], &vcs = b[V_COL_SCALE];
  if (kc.dim() != 5 || vc.dim() != 5 || kcs.dim() != 4 || vcs.dim() != 4 || sink_k.dim() != 4
      || sink_v.dim() != 4 || kcs.size(3) <= 0 || vcs.size(3) <= 0) return {};
  const int64_t G = kcs.size(3), D = sink_k.size(3), DV = sink_v.size(3);
  const int64_t kb = 8 * kc.size(4) / G, vb = 8 * vc.size(4) / vcs.size(3);
  auto exact = [](at::ScalarType t) { return t == torch::kHalf || t == torch::kBFloat16 || t == torch::kFloat; };
  auto bits_ok = [](int64_t x) { return x == 2 || x == 3 || x == 4 || x == 8; };
  const auto st = b[K_ROW_SCALE].scalar_type(), zt = b[K_ROW_ZERO].scalar_type();
  const bool scales_ok = fp8 ? st == at::kFloat8_e4m3fn : exact(st);
  if (!bits_ok(kb) || !bits_ok(vb) || G % 16 || D <= 0 || DV <= 0 || !scales_ok || !exact(zt)
      || !exact(sink_k.scalar_type()) || sink_v.scalar_type() != sink_k.scalar_type()
      || b[TAIL_K].scalar_type() != sink_k.scalar_type() || b[TAIL_V].scalar_type() != sink_k.scalar_type())
    return {};
  for (int i : {K_COL_SCALE, V_ROW_SCALE, V_COL_SCALE})
    if (b[i].scalar_type() != st) return {};
  if (b[V_ROW_ZERO].scalar_type() != zt) return {};
  if (fp8)
    for (size_t i = N_BASE; i < N_BASE + 4; ++i)
      if (!exact(b[i].scalar_type())) return {};
  // the reference's checks (ops/attention.py: check_latent_queries, check_mask)
  const int64_t B = sink_k.size(0), H = sink_k.size(1);
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(0) == B && q.size(3) == D && q.size(1) % H == 0,
                    "KVarN attention: expected queries [batch=", B, ", heads=k*", H, ", tq, head_dim=", D,
                    "], but got ", py_shape(q.sizes()), ".");
  TORCH_CHECK_VALUE(q_pe.dim() == 4 && q_pe.size(0) == q.size(0) && q_pe.size(1) == q.size(1)
                    && q_pe.size(2) == q.size(2) && q_pe.size(3) == DV,
                    "KVarN latent_attention: expected RoPE queries [", q.size(0), ", ", q.size(1), ", ",
                    q.size(2), ", rope_dim=", DV, "] like the latent queries, but got ", py_shape(q_pe.sizes()), ".");
  const auto lengths = b[LENGTHS].to(torch::kLong).contiguous();
  std::optional<torch::Tensor> m;
  if (mask.has_value() && mask->defined()) {
    int64_t held = 0;
    const int64_t* lp = lengths.data_ptr<int64_t>();
    for (int64_t i = 0; i < lengths.numel(); ++i) held = std::max(held, lp[i]);
    TORCH_CHECK_VALUE(mask->size(-1) >= held, "KVarN attention: the mask covers ", mask->size(-1),
                      " key positions, but the cache holds up to ", held, "; expected a mask as long as the cache.");
    const auto mk = mask->scalar_type() == torch::kBool ? mask->view(torch::kByte) : mask->to(torch::kFloat);
    m = mk.expand({B, q.size(1), q.size(2), mk.size(-1)});
  }
  // geometry of the packed tiles (never read a buffer with another geometry)
  const int64_t N = kc.size(2);
  TORCH_CHECK(kc.size(0) == B && kc.size(1) == H && kc.size(3) == D && vc.sizes() == at::IntArrayRef({B, H, N, G, vc.size(4)})
              && vc.size(4) * 8 == DV * vb && vcs.size(3) == DV && kcs.sizes() == at::IntArrayRef({B, H, N, G})
              && b[K_ROW_SCALE].sizes() == at::IntArrayRef({B, H, N, D}) && b[K_ROW_ZERO].sizes() == b[K_ROW_SCALE].sizes()
              && b[V_ROW_SCALE].sizes() == kcs.sizes() && b[V_ROW_ZERO].sizes() == kcs.sizes()
              && vcs.sizes() == at::IntArrayRef({B, H, N, DV}) && sink_v.size(0) == B && sink_v.size(1) == H
              && sink_v.size(2) == sink_k.size(2) && b[TAIL_K].dim() == 4 && b[TAIL_V].dim() == 4
              && b[TAIL_K].size(0) == B && b[TAIL_K].size(1) == H && b[TAIL_K].size(3) == D
              && b[TAIL_V].sizes() == at::IntArrayRef({B, H, b[TAIL_K].size(2), DV})
              && lengths.numel() == B && b[N_TILES].numel() == B,
              "kvarn CPU latent kernel: the state's buffers do not match its geometry");
  TORCH_CHECK(rot.dim() == 2 && rot.size(0) == D && rot.size(1) == D && rot_t.sizes() == rot.sizes()
              && rot_pe.dim() == 2 && rot_pe.size(0) == DV && rot_pe.size(1) == DV,
              "kvarn CPU latent kernel: expected rotations [D, D] x2 and [Dv, Dv], D = ", D, ", Dv = ", DV);
  for (const auto* t : {&rot, &rot_t, &rot_pe})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == torch::kFloat,
                "kvarn CPU latent kernel: expected contiguous fp32 CPU rotations");
  std::vector<torch::Tensor> c(N_BASE);
  for (int i = 0; i < N_BASE; ++i) c[i] = b[i].contiguous();
  const auto n_tiles = c[N_TILES].to(torch::kLong);
  const auto q32 = q.to(torch::kFloat).contiguous();
  const auto pe32 = q_pe.to(torch::kFloat).contiguous();
  // the exact region reads [q | q_pe] in q's dtype (the reference concatenates them)
  const auto pe_exact = q_pe.scalar_type() == q.scalar_type() ? pe32 : q_pe.to(q.scalar_type()).to(torch::kFloat).contiguous();
  auto out = torch::empty({B, q.size(1), q.size(2), D}, q.options().dtype(torch::kFloat));
  if (out.numel() == 0) return out.to(q.scalar_type());
  Latent a;
  a.B = B; a.H = H; a.HQ = q.size(1); a.TQ = q.size(2); a.D = D; a.DV = DV; a.N = N; a.G = G;
  a.kb = kb; a.vb = vb;
  a.q = q32.data_ptr<float>(); a.pe = pe32.data_ptr<float>(); a.pe_exact = pe_exact.data_ptr<float>();
  a.rot = rot.data_ptr<float>(); a.rot_t = rot_t.data_ptr<float>(); a.rot_pe = rot_pe.data_ptr<float>();
  a.sink_k = c[SINK_K].data_ptr(); a.sink_v = c[SINK_V].data_ptr();
  a.tail_k = c[TAIL_K].data_ptr(); a.tail_v = c[TAIL_V].data_ptr();
  a.exact_dt = dt_of(c[SINK_K]); a.S = sink_k.size(2); a.W = b[TAIL_K].size(2);
  a.kc = c[K_CODES].data_ptr<uint8_t>(); a.vc = c[V_CODES].data_ptr<uint8_t>();
  a.krs = c[K_ROW_SCALE].data_ptr(); a.krz = c[K_ROW_ZERO].data_ptr(); a.kcs = c[K_COL_SCALE].data_ptr();
  a.vrs = c[V_ROW_SCALE].data_ptr(); a.vrz = c[V_ROW_ZERO].data_ptr(); a.vcs = c[V_COL_SCALE].data_ptr();
  a.scale_dt = fp8 ? F8 : dt_of(c[K_ROW_SCALE]);
  a.zero_dt = dt_of(c[K_ROW_ZERO]);
  std::vector<torch::Tensor> factors;
  if (fp8) {
    for (int i = 0; i < 4; ++i) {
      factors.push_back(b[N_BASE + i].contiguous());
      TORCH_CHECK(factors.back().numel() == B * H * N && factors.back().scalar_type() == factors[0].scalar_type(),
                  "kvarn CPU latent kernel: expected fp8 factors [B, H, N, 1] of one dtype");
    }
    a.krf = factors[0].data_ptr(); a.kcf = factors[1].data_ptr();
    a.vrf = factors[2].data_ptr(); a.vcf = factors[3].data_ptr();
    a.factor_dt = dt_of(factors[0]);
  }
  torch::Tensor k_plain;
  if (frames) {
    k_plain = b[nb - 1].to(torch::kByte).contiguous();
    TORCH_CHECK(k_plain.numel() == B * H * N, "kvarn CPU latent kernel: expected k_plain as [B, H, N]");
    a.k_plain = k_plain.data_ptr<uint8_t>();
  }
  a.lengths = lengths.data_ptr<int64_t>(); a.n_tiles = n_tiles.data_ptr<int64_t>();
  if (m.has_value()) {
    a.mask = m->data_ptr(); a.mask_float = m->scalar_type() == torch::kFloat;
    a.msb = m->stride(0); a.msh = m->stride(1); a.msq = m->stride(2); a.msm = m->stride(3);
  }
  a.scale = (float)scale; a.causal = causal; a.window = (int)window;
  a.task_rows = (int)std::max<int64_t>(1, task_rows);
  a.out = out.data_ptr<float>();
  run_latent(a);
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}
