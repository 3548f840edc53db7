// A whole KVarN decode attention step over the packed cache (kernels/cpu/attention.py is
// its launcher and describes it): the exact sink and tail, the packed tiles unpacked in
// registers (dual-scale fold), one online softmax, the rotations inside the call. Work is
// split over (batch row, kv head, range of units), merged by log-sum-exp. Keys (D) and
// values (Dv) may have different head dims (MLA decompressed): D for scores, Dv for outputs.
// Built by kernels/cpu/build.py with -O3 -march=native -ffp-contract=fast -fopenmp,
// together with append.cpp, into one extension whose module this file defines.
#include "kvarn_common.h"
#include "attention_common.h"   // vectors, vexp, dtype conversion, unpacking, softmax_step

#include <limits>
#include <memory>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__) || defined(__AVX2__)
#define MAX_NR_4 1
constexpr int MAX_NR = 4;   // query rows per register block (accumulators: NR * codes per byte)
#else
#define MAX_NR_4 0
constexpr int MAX_NR = 2;
#endif
constexpr int EB = 32;      // exact-region tokens per block

// 16 bytes -> 16 int32 lanes (vpmovzxbd; the generic conversion is scalarized by GCC)
inline v16i bytes16(const uint8_t* p) {
#if defined(__AVX512F__)
  return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  v16i r;
  std::memcpy(&r, &lo, 32);
  std::memcpy((char*)&r + 32, &hi, 32);
  return r;
#else
  v16b v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, v16i);
#endif
}
// Codes at shift K (of BITS-bit codes packed in the bytes w) as floats.
template <int BITS, int K>
inline v16f codes_f(v16i w) {
  constexpr int MASK = (1 << BITS) - 1;
#if defined(__AVX512F__)
  if (BITS == 4 || BITS == 2) {   // vpermps reads the low 4 index bits: a table lookup, no mask
    const __m512 table = BITS == 4
        ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
        : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    const v16i idx = K ? w >> (K * BITS) : w;
    return (v16f)_mm512_permutexvar_ps((__m512i)idx, table);
  }
#endif
  return __builtin_convertvector(K ? (w >> (K * BITS)) & MASK : (BITS == 8 ? w : w & MASK), v16f);
}

// out[i] = sum of the lanes of v[i], i < 16 (a transposing add tree: ~3 ops per vector
// instead of a full horizontal sum each)
inline v16f reduce16(const v16f* v) {
#if defined(__AVX512F__)
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {      // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    const __m512 a = (__m512)v[2 * i], b = (__m512)v[2 * i + 1];
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {      // per 128-bit lane: the lane sums of 4 vectors
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)        // add 128-bit lanes pairwise
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return (v16f)_mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
#else
  v16f out;
  for (int i = 0; i < 16; ++i) out[i] = hsum(v[i]);
  return out;
#endif
}

// ---------------------------------------------------------------- tile inner loops
// Scores of NR rows against one K tile [D, G] packed along tokens (NB bytes per channel row):
// s[r][k * NB + j] = sum_c qs[r][c] * code[c, j * PER + k]
template <int KB, int NR>
void k_scores(const uint8_t* codes, int D, int NB, const float* qs, int qstride, float* s, int sstride) {
  constexpr int PER = 8 / KB;
  for (int jb = 0; jb < NB; jb += 16) {
    v16f acc[NR][PER];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < PER; ++k) acc[r][k] = v16f{};
    const uint8_t* p = codes + jb;
    for (int c = 0; c < D; ++c, p += NB) {
      const v16i w = bytes16(p);
      v16f x[PER];
      x[0] = codes_f<KB, 0>(w);
      if (PER > 1) x[1] = codes_f<KB, (PER > 1 ? 1 : 0)>(w);
      if (PER > 2) x[2] = codes_f<KB, (PER > 2 ? 2 : 0)>(w);
      if (PER > 3) x[3] = codes_f<KB, (PER > 3 ? 3 : 0)>(w);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const float qv = qs[r * qstride + c];
#pragma GCC unroll 4
        for (int k = 0; k < PER; ++k) acc[r][k] += qv * x[k];
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < PER; ++k) vst(s + r * sstride + k * NB + jb, acc[r][k]);
  }
}

// Weighted sum of NR rows of weights over one V tile [G, D] packed along channels (NB bytes
// per token row): o[r][k * NB + j] = sum_t w[r][t'] * code[t, j * PER + k], where the
// weights are in the K score order t' = (t % kper) * knb + t / kper.
template <int VB, int NR>
void v_sums(const uint8_t* codes, int NB, int kper, int knb, const float* w, int wstride, float* o, int ostride) {
  constexpr int PER = 8 / VB;
  for (int jb = 0; jb < NB; jb += 16) {
    v16f acc[NR][PER];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < PER; ++k) acc[r][k] = v16f{};
    for (int kk = 0; kk < kper; ++kk) {
      const float* wk = w + kk * knb;
      const uint8_t* p = codes + (int64_t)kk * NB + jb;
      for (int j = 0; j < knb; ++j, p += (int64_t)kper * NB) {
        const v16i b = bytes16(p);
        v16f x[PER];
        x[0] = codes_f<VB, 0>(b);
        if (PER > 1) x[1] = codes_f<VB, (PER > 1 ? 1 : 0)>(b);
        if (PER > 2) x[2] = codes_f<VB, (PER > 2 ? 2 : 0)>(b);
        if (PER > 3) x[3] = codes_f<VB, (PER > 3 ? 3 : 0)>(b);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          const float wv = wk[r * wstride + j];
#pragma GCC unroll 4
          for (int k = 0; k < PER; ++k) acc[r][k] += wv * x[k];
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < PER; ++k) vst(o + r * ostride + k * NB + jb, acc[r][k]);
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 forms of the two tile loops above, on native 8-lane registers: GCC lowers the 16-lane
// vector extensions to stack spills and lane inserts there (5x slower). Same results: each
// score / weighted sum accumulates over the same terms in the same order.
template <int BITS>
inline void codes8(const uint8_t* p, __m256* x) {     // 8 bytes -> PER x 8 codes as floats
  constexpr int PER = 8 / BITS;
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  if (BITS == 8) { x[0] = _mm256_cvtepi32_ps(w); return; }
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  x[0] = _mm256_cvtepi32_ps(_mm256_and_si256(w, mask));
  for (int k = 1; k < PER; ++k)
    x[k] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, k * BITS), mask));
}

template <int KB, int NR>
void k_scores8(const uint8_t* codes, int D, int NB, const float* qs, int qstride, float* s, int sstride) {
  constexpr int PER = 8 / KB;
  for (int jb = 0; jb < NB; jb += 8) {
    __m256 acc[NR][PER];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < PER; ++k) acc[r][k] = _mm256_setzero_ps();
    const uint8_t* p = codes + jb;
    for (int c = 0; c < D; ++c, p += NB) {
      __m256 x[PER];
      codes8<KB>(p, x);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const __m256 qv = _mm256_broadcast_ss(qs + r * qstride + c);
#pragma GCC unroll 4
        for (int k = 0; k < PER; ++k) acc[r][k] = fmadd8(qv, x[k], acc[r][k]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < PER; ++k) _mm256_storeu_ps(s + r * sstride + k * NB + jb, acc[r][k]);
  }
}

template <int VB, int NR>
void v_sums8(const uint8_t* codes, int NB, int kper, int knb, const float* w, int wstride, float* o, int ostride) {
  constexpr int PER = 8 / VB;
  for (int jb = 0; jb < NB; jb += 8) {
    __m256 acc[NR][PER];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < PER; ++k) acc[r][k] = _mm256_setzero_ps();
    for (int kk = 0; kk < kper; ++kk) {
      const float* wk = w + kk * knb;
      const uint8_t* p = codes + (int64_t)kk * NB + jb;
      for (int j = 0; j < knb; ++j, p += (int64_t)kper * NB) {
        __m256 x[PER];
        codes8<VB>(p, x);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          const __m256 wv = _mm256_broadcast_ss(wk + r * wstride + j);
#pragma GCC unroll 4
          for (int k = 0; k < PER; ++k) acc[r][k] = fmadd8(wv, x[k], acc[r][k]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < PER; ++k) _mm256_storeu_ps(o + r * ostride + k * NB + jb, acc[r][k]);
  }
}
#define KVARN_K_SCORES k_scores8
#define KVARN_V_SUMS v_sums8
#else
#define KVARN_K_SCORES k_scores
#define KVARN_V_SUMS v_sums
#endif

// The small dense loops below have AVX2 forms too: a 16-lane accumulator carried across a
// loop is kept in memory there (moved through general registers, ~10x slower), which made
// the rotations and the exact region (sink and tail) a fixed cost of ~70 us per call.
#if KVARN_AVX2_ONLY
inline __m256 reduce8(const __m256* v) {     // out[i] = sum of the lanes of v[i], i < 8
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// out[j] = scale * (init[j] + sum_i x[i] * M[rows[i] * D + j]), j < D (rows null: i;
// init null: 0): a row of queries times the rotation, or the merge's rotation back.
// NB column blocks of 16 at once, from column j0: NB independent accumulator chains (one
// chain of D dependent multiply-adds per block was bound by the add latency: the two
// rotations were about half of a short decode step's kernel time). Each output still sums
// over i in order: the same bits as one block at a time.
template <int NB>
inline void vec_mat_blocks(const float* x, const float* M, const int* rows, int D, int j0,
                           const float* init, float scale, float* out) {
#if KVARN_AVX2_ONLY
  __m256 acc[2 * NB];
  for (int b = 0; b < 2 * NB; ++b) acc[b] = init ? _mm256_loadu_ps(init + j0 + 8 * b) : _mm256_setzero_ps();
  for (int i = 0; i < D; ++i) {
    const __m256 xv = _mm256_broadcast_ss(x + i);
    const float* m = M + (int64_t)(rows ? rows[i] : i) * D + j0;
    for (int b = 0; b < 2 * NB; ++b) acc[b] = fmadd8(xv, _mm256_loadu_ps(m + 8 * b), acc[b]);
  }
  const __m256 sv = _mm256_set1_ps(scale);
  for (int b = 0; b < 2 * NB; ++b) _mm256_storeu_ps(out + j0 + 8 * b, _mm256_mul_ps(acc[b], sv));
#else
  v16f acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = init ? vld(init + j0 + 16 * b) : v16f{};
  for (int i = 0; i < D; ++i) {
    const float* m = M + (int64_t)(rows ? rows[i] : i) * D + j0;
    const float xi = x[i];
    for (int b = 0; b < NB; ++b) acc[b] += xi * vld(m + 16 * b);
  }
  for (int b = 0; b < NB; ++b) vst(out + j0 + 16 * b, acc[b] * splat(scale));
#endif
}

inline void vec_mat(const float* x, const float* M, const int* rows, int D, const float* init,
                    float scale, float* out) {
  int j = 0;
  for (; j + 64 <= D; j += 64) vec_mat_blocks<4>(x, M, rows, D, j, init, scale, out);
  switch ((D - j) / 16) {
    case 3: vec_mat_blocks<3>(x, M, rows, D, j, init, scale, out); break;
    case 2: vec_mat_blocks<2>(x, M, rows, D, j, init, scale, out); break;
    case 1: vec_mat_blocks<1>(x, M, rows, D, j, init, scale, out); break;
    default: break;
  }
}

// v[i] = scale * <q, k[i]>, i < n (n a multiple of 16; k: n rows of D floats)
inline void exact_scores(const float* q, const float* k, int n, int D, float scale, float* v) {
#if KVARN_AVX2_ONLY
  const __m256 sv = _mm256_set1_ps(scale);
  for (int i0 = 0; i0 < n; i0 += 8) {        // 8 tokens' dot products, then one add tree
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    const float* kr = k + (int64_t)i0 * D;
    for (int c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = fmadd8(qv, _mm256_loadu_ps(kr + (int64_t)i * D + c), acc[i]);
    }
    _mm256_storeu_ps(v + i0, _mm256_mul_ps(reduce8(acc), sv));
  }
#else
  for (int i0 = 0; i0 < n; i0 += 16) {       // 16 tokens' dot products, then one add tree
    v16f acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = v16f{};
    const float* kr = k + (int64_t)i0 * D;
    for (int c = 0; c < D; c += 16) {         // 16 independent accumulators
      const v16f qv = vld(q + c);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] += qv * vld(kr + (int64_t)i * D + c);
    }
    vst(v + i0, reduce16(acc) * splat(scale));
  }
#endif
}

// o[r][c] += sum_i w[r][i] * x[i][c] for NR rows over cnt exact rows x [cnt, D] (fp32)
template <int NR>
void exact_pv(const float* x, int cnt, int D, const float* w, int wstride, float* o, int ostride) {
#if KVARN_AVX2_ONLY
  for (int c = 0; c < D; c += 16) {
    __m256 acc[NR][2];
    for (int r = 0; r < NR; ++r) {
      acc[r][0] = _mm256_loadu_ps(o + r * ostride + c);
      acc[r][1] = _mm256_loadu_ps(o + r * ostride + c + 8);
    }
    for (int i = 0; i < cnt; ++i) {
      const __m256 x0 = _mm256_loadu_ps(x + (int64_t)i * D + c), x1 = _mm256_loadu_ps(x + (int64_t)i * D + c + 8);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const __m256 wv = _mm256_broadcast_ss(w + r * wstride + i);
        acc[r][0] = fmadd8(wv, x0, acc[r][0]);
        acc[r][1] = fmadd8(wv, x1, acc[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_ps(o + r * ostride + c, acc[r][0]);
      _mm256_storeu_ps(o + r * ostride + c + 8, acc[r][1]);
    }
  }
  return;
#endif
  for (int c = 0; c < D; c += 16) {
    v16f acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = vld(o + r * ostride + c);
    for (int i = 0; i < cnt; ++i) {
      const v16f xv = vld(x + (int64_t)i * D + c);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[r] += w[r * wstride + i] * xv;
    }
    for (int r = 0; r < NR; ++r) vst(o + r * ostride + c, acc[r]);
  }
}
typedef void (*PFn)(const float*, int, int, const float*, int, float*, int);
PFn pick_pv(int nr) {
  switch (nr) {
    case 1: return exact_pv<1>;
    case 2: return exact_pv<2>;
#if MAX_NR_4
    case 3: return exact_pv<3>;
    case 4: return exact_pv<4>;
#endif
  }
  return nullptr;
}

typedef void (*KFn)(const uint8_t*, int, int, const float*, int, float*, int);
typedef void (*VFn)(const uint8_t*, int, int, int, const float*, int, float*, int);

template <int B>
KFn k_fn(int nr) {
  switch (nr) {
    case 1: return KVARN_K_SCORES<B, 1>;
    case 2: return KVARN_K_SCORES<B, 2>;
#if MAX_NR_4
    case 3: return KVARN_K_SCORES<B, 3>;
    case 4: return KVARN_K_SCORES<B, 4>;
#endif
  }
  return nullptr;
}
template <int B>
VFn v_fn(int nr) {
  switch (nr) {
    case 1: return KVARN_V_SUMS<B, 1>;
    case 2: return KVARN_V_SUMS<B, 2>;
#if MAX_NR_4
    case 3: return KVARN_V_SUMS<B, 3>;
    case 4: return KVARN_V_SUMS<B, 4>;
#endif
  }
  return nullptr;
}
KFn pick_k(int bits, int nr) { return bits == 2 ? k_fn<2>(nr) : bits == 4 ? k_fn<4>(nr) : k_fn<8>(nr); }
VFn pick_v(int bits, int nr) { return bits == 2 ? v_fn<2>(nr) : bits == 4 ? v_fn<4>(nr) : v_fn<8>(nr); }

// ---------------------------------------------------------------- the call
struct Call {
  const float* q = nullptr;      // [B, HQ, TQ, D] un-rotated (null: tiles only, no plain tiles)
  const float* qrot = nullptr;   // [B, HQ, TQ, D] rotated, or null: q @ rot
  const float* rot = nullptr;    // [D, D] the keys' rotation
  const float* rot_t = nullptr;  // [DV, DV] the values' rotation^T, or null: the output stays rotated
  const void *sink_k = nullptr, *sink_v = nullptr, *tail_k = nullptr, *tail_v = nullptr;
  int exact_dt = F32, S = 0, W = 0;
  const uint8_t *kc = nullptr, *vc = nullptr;
  const void *krs, *krz, *kcs, *vrs, *vrz, *vcs;
  int scale_dt = F32;
  const int64_t* lengths = nullptr;   // null: tiles-only mode (positions = tile token index)
  const int64_t* n_tiles = nullptr;
  const int64_t* kv_start = nullptr;  // [B, TQ], tiles-only mode
  const uint8_t* k_plain = nullptr;   // [B, H, N]
  const void* mask = nullptr; int mask_float = 0; int64_t msb = 0, msh = 0, msq = 0, msm = 0;
  int B, H, HQ, TQ, D, N, G, kb, vb;
  int DV;                             // the values' (and output's) head dim; D for most models
  float scale; bool causal = false; int window = 0;
  int splits = 1;
  float* out; float* lse;             // [B, HQ, TQ, DV], [B, HQ, TQ]
};

void run(const Call& a) {
  // D: scores (q, keys); DV: values and output (sink/tail values, V tiles, accumulators)
  const int B = a.B, H = a.H, HQ = a.HQ, TQ = a.TQ, D = a.D, DV = a.DV, N = a.N, G = a.G;
  const int grp = HQ / H, R = grp * TQ;
  const bool fused = a.lengths != nullptr;
  // packed row sizes and the vector path (16-byte blocks) or the byte-unpack path
  const int knb_packed = G * a.kb / 8, vnb_packed = DV * a.vb / 8;
  const bool k_native = (a.kb == 2 || a.kb == 4 || a.kb == 8) && knb_packed % 16 == 0;
  const bool v_native = (a.vb == 2 || a.vb == 4 || a.vb == 8) && vnb_packed % 16 == 0;
  const int kbits = k_native ? a.kb : 8, vbits = v_native ? a.vb : 8;
  const int kper = 8 / kbits, vper = 8 / vbits;
  const int knb = G / kper, vnb = DV / vper;   // bytes per row as the loops read them
  KFn kf[MAX_NR + 1]; VFn vf[MAX_NR + 1]; PFn pf[MAX_NR + 1];
  for (int nr = 1; nr <= MAX_NR; ++nr) { kf[nr] = pick_k(kbits, nr); vf[nr] = pick_v(vbits, nr); pf[nr] = pick_pv(nr); }
  const int splits = a.splits;
  const int64_t ntasks = (int64_t)B * H * splits;
  std::vector<float> part_plain(fused ? ntasks * R * DV : 0), part_rot(ntasks * R * DV);
  std::vector<float> part_m(ntasks * R, NEG_INF), part_l(ntasks * R, 0.f);
  std::atomic<int64_t> next{0};
  const int nthreads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), ntasks));

  // value-code order of the rotated accumulators: index k * vnb + j holds channel j * vper + k
  std::vector<int> chan(DV);
  for (int i = 0; i < DV; ++i) chan[i] = (i % vnb) * vper + i / vnb;
  // Merge the splits of one (batch row, kv head) into the output; run by the task that
  // finishes its last split (one parallel region: no second barrier).
  auto merge = [&](int64_t bh, float* rot, float* plain) {
    const int b = bh / H, h = bh % H;
    for (int r = 0; r < R; ++r) {
      const int gi = r / TQ, tq = r % TQ;
      const int64_t orow = ((int64_t)b * HQ + h * grp + gi) * TQ + tq;
      float M = NEG_INF;
      for (int sp = 0; sp < splits; ++sp) M = std::max(M, part_m[(bh * splits + sp) * R + r]);
      float* o = a.out + orow * DV;
      if (!(M > NEG_INF)) {
        std::fill(o, o + DV, 0.f);
        if (a.lse) a.lse[orow] = NEG_INF;
        continue;
      }
      bool poisoned = false;
      for (int sp = 0; sp < splits; ++sp) {
        const int64_t i = (bh * splits + sp) * R + r;
        poisoned |= part_m[i] > NEG_INF && std::isnan(part_l[i]);
      }
      if (poisoned) {
        std::fill(o, o + DV, std::numeric_limits<float>::quiet_NaN());
        if (a.lse) a.lse[orow] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      float L = 0.f;
      std::fill(rot, rot + DV, 0.f);
      std::fill(plain, plain + DV, 0.f);
      for (int sp = 0; sp < splits; ++sp) {
        const int64_t i = (bh * splits + sp) * R + r;
        if (!(part_m[i] > NEG_INF)) continue;
        const float w = std::exp(part_m[i] - M);
        L += w * part_l[i];
        const float* pr = part_rot.data() + i * DV;
        for (int c = 0; c < DV; ++c) rot[c] += w * pr[c];
        if (fused) {
          const float* pp = part_plain.data() + i * DV;
          for (int c = 0; c < DV; ++c) plain[c] += w * pp[c];
        }
      }
      const float inv = L > 0.f ? 1.f / L : 0.f;
      if (a.lse) a.lse[orow] = L > 0.f ? std::log(L) + M : NEG_INF;
      if (a.rot_t) {
        vec_mat(rot, a.rot_t, chan.data(), DV, plain, inv, o);
      } else {
        for (int i = 0; i < DV; ++i) o[chan[i]] = (rot[i] + (fused ? plain[chan[i]] : 0.f)) * inv;
      }
    }
  };
  // rotated queries q @ rot, once for all tasks
  std::vector<float> qrot_buf;
  const float* qrot = a.qrot;
  if (!qrot) {
    const int64_t rows = (int64_t)B * HQ * TQ;
    qrot_buf.assign(rows * D, 0.f);
    for (int64_t r = 0; r < rows; ++r)
      vec_mat(a.q + r * D, a.rot, nullptr, D, nullptr, 1.f, qrot_buf.data() + r * D);
    qrot = qrot_buf.data();
  }
  // Per query row (b, query head, tq): 1 when the mask hides nothing of the packed-tile
  // region [S, S + n_tiles * G) (the usual decode mask), so the tile loop skips its per-token
  // mask lookups there; positions outside a row's causal/window range are still hidden.
  std::vector<char> tiles_open((size_t)B * HQ * TQ, 0);
  if (a.mask && fused) {
    for (int b = 0; b < B; ++b) {
      const int64_t p_end = a.S + std::min<int64_t>(std::max<int64_t>(a.n_tiles[b], 0), N) * G;
      for (int qh = 0; qh < HQ; ++qh)
        for (int tq = 0; tq < TQ; ++tq) {
          const int64_t off = b * a.msb + (int64_t)qh * a.msh + tq * a.msq;
          bool open = true;
          if (a.mask_float) {
            const float* mf = (const float*)a.mask + off;
            for (int64_t p = a.S; p < p_end && open; ++p) open = mf[p * a.msm] == 0.f;
          } else {
            const uint8_t* mb = (const uint8_t*)a.mask + off;
            for (int64_t p = a.S; p < p_end && open; ++p) open = mb[p * a.msm] != 0;
          }
          tiles_open[((size_t)b * HQ + qh) * TQ + tq] = open;
        }
    }
  }
  std::unique_ptr<std::atomic<int>[]> done(new std::atomic<int>[B * H]);
  for (int64_t i = 0; i < (int64_t)B * H; ++i) done[i].store(0, std::memory_order_relaxed);

  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    std::vector<float> qs((size_t)R * D), s((size_t)R * std::max(G, EB)),
        tmp((size_t)R * DV), bias(R), zsum(R), alpha(R), kfl((size_t)EB * D), vfl((size_t)EB * DV);
    std::vector<float> ks(D), kz(D), kcs(G), vs(G), vz(G), vcs(DV), ctmp(std::max(G, std::max(D, DV)));
    std::vector<uint8_t> k8(k_native ? 0 : (size_t)D * G), v8(v_native ? 0 : (size_t)G * DV);
    std::vector<int64_t> lo(TQ), hi(TQ);
    std::vector<char> live(R);
    std::vector<float> mrot(DV), mplain(DV);
    int64_t task = -1;
    auto finish = [&]() {
      const int64_t bh = task / splits;
      if (done[bh].fetch_add(1, std::memory_order_acq_rel) == splits - 1) merge(bh, mrot.data(), mplain.data());
    };
    for (; (task = next.fetch_add(1)) < ntasks; finish()) {
      const int sp = task % splits;
      const int64_t bh = task / splits;
      const int b = bh / H, h = bh % H;
      float* acc_rot = part_rot.data() + task * R * DV;
      float* acc_plain = fused ? part_plain.data() + task * R * DV : nullptr;
      float* m = part_m.data() + task * R;
      float* l = part_l.data() + task * R;
      const int nt = (int)std::min<int64_t>(std::max<int64_t>(a.n_tiles[b], 0), N);
      const int units = nt + (fused ? 2 : 0);
      const int per = (units + splits - 1) / splits;
      const int u0 = sp * per, u1 = std::min(units, u0 + per);
      if (u0 >= u1) continue;
      const int64_t qoff = ((int64_t)b * HQ + (int64_t)h * grp) * TQ * D;   // rows r = gi * TQ + tq
      const float* qp = a.q ? a.q + qoff : nullptr;
      const float* qr = qrot + qoff;
      // visible positions per query: [lo, hi]
      int64_t lo_min = std::numeric_limits<int64_t>::max(), hi_max = std::numeric_limits<int64_t>::min();
      const int64_t len = fused ? a.lengths[b] : 0;
      for (int tq = 0; tq < TQ; ++tq) {
        if (fused) {
          const int64_t qpos = len - TQ + tq;
          lo[tq] = a.window > 0 ? qpos - a.window + 1 : std::numeric_limits<int64_t>::min();
          hi[tq] = a.causal ? qpos : std::numeric_limits<int64_t>::max();
        } else {
          lo[tq] = a.kv_start ? a.kv_start[(int64_t)b * TQ + tq] : std::numeric_limits<int64_t>::min();
          hi[tq] = std::numeric_limits<int64_t>::max();
        }
        lo_min = std::min(lo_min, lo[tq]);
        hi_max = std::max(hi_max, hi[tq]);
      }
      auto apply_mask = [&](int r, int64_t pos, float x) -> float {   // row r's mask at pos
        const int gi = r / TQ, tq = r % TQ;
        const int64_t off = b * a.msb + (int64_t)(h * grp + gi) * a.msh + tq * a.msq + pos * a.msm;
        if (a.mask_float) return x + ((const float*)a.mask)[off];          // additive
        return ((const uint8_t*)a.mask)[off] ? x : NEG_INF;                // bool: hides
      };
      const int64_t tile_pos0 = fused ? a.S : 0;

      for (int u = u0; u < u1; ++u) {
        if (fused && (u == 0 || u == nt + 1)) {
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
          for (int t0 = 0; t0 < slots; t0 += EB) {
            int64_t pos[EB], pmin, pmax; int slot[EB];
            const int cnt = exact_slots(tail, t0, slots, EB, base, off0, a.S, a.W, len, lo_min,
                                        hi_max, pos, slot, pmin, pmax);
            if (!cnt) continue;
            const int n16 = (cnt + 15) / 16 * 16;
            const bool run_of_slots = slot[cnt - 1] - slot[0] == cnt - 1;   // one conversion call
            if (run_of_slots) to_float(kb_, a.exact_dt, (row0 + slot[0]) * D, kfl.data(), cnt * D);
            else for (int i = 0; i < cnt; ++i) to_float(kb_, a.exact_dt, (row0 + slot[i]) * D, kfl.data() + i * D, D);
            std::fill(kfl.begin() + (int64_t)cnt * D, kfl.begin() + (int64_t)n16 * D, 0.f);
            for (int r = 0; r < R; ++r) {
              const int tq = r % TQ;
              float* v = s.data() + r * EB;
              const float* qrow = qp + r * D;
              exact_scores(qrow, kfl.data(), n16, D, a.scale, v);
              for (int i = 0; i < cnt; ++i) {
                if (pos[i] < lo[tq] || pos[i] > hi[tq]) v[i] = NEG_INF;
                else if (a.mask) v[i] = apply_mask(r, pos[i], v[i]);
              }
              for (int i = cnt; i < n16; ++i) v[i] = NEG_INF;
              const float al = softmax_step(v, n16, m[r], l[r]);
              live[r] = al >= 0.f;
              if (al >= 0.f && al != 1.f) { scale_rows(acc_plain + r * DV, DV, al); scale_rows(acc_rot + r * DV, DV, al); }
            }
            if (run_of_slots) to_float(vb_, a.exact_dt, (row0 + slot[0]) * DV, vfl.data(), cnt * DV);
            else for (int i = 0; i < cnt; ++i) to_float(vb_, a.exact_dt, (row0 + slot[i]) * DV, vfl.data() + i * DV, DV);
            // (rows that see none of these tokens have all-zero weights: as in p @ V, a
            // NaN value there still reaches them)
            for (int r0 = 0; r0 < R; r0 += MAX_NR) {
              const int nr = std::min(MAX_NR, R - r0);
              pf[nr](vfl.data(), cnt, DV, s.data() + r0 * EB, EB, acc_plain + r0 * DV, DV);
            }
          }
          continue;
        }
        // -------------------------------------------------- one packed tile
        const int j = fused ? u - 1 : u;
        const int64_t p0 = tile_pos0 + (int64_t)j * G, p1 = p0 + G - 1;
        if (p1 < lo_min || p0 > hi_max) continue;
        const int64_t tile = bh * N + j;
        to_float(a.krs, a.scale_dt, tile * D, ks.data(), D);
        to_float(a.krz, a.scale_dt, tile * D, kz.data(), D);
        to_float_perm(a.kcs, a.scale_dt, tile * G, ctmp.data(), kcs.data(), G, kper);
        for (int i = 0; i < G; i += 16) vst(kcs.data() + i, vld(kcs.data() + i) * splat(a.scale));
        to_float_perm(a.vrs, a.scale_dt, tile * G, ctmp.data(), vs.data(), G, kper);
        to_float_perm(a.vrz, a.scale_dt, tile * G, ctmp.data(), vz.data(), G, kper);
        to_float_perm(a.vcs, a.scale_dt, tile * DV, ctmp.data(), vcs.data(), DV, vper);
        const bool plain = a.k_plain && a.k_plain[tile];
        const float* qsrc = plain ? qp : qr;
        for (int r = 0; r < R; ++r) {
          const float* x = qsrc + r * D;
          float* o = qs.data() + r * D;
#if KVARN_AVX2_ONLY
          __m256 b8 = _mm256_setzero_ps();
          for (int c = 0; c < D; c += 8) {
            const __m256 xv = _mm256_loadu_ps(x + c);
            _mm256_storeu_ps(o + c, _mm256_mul_ps(xv, _mm256_loadu_ps(ks.data() + c)));
            b8 = fmadd8(xv, _mm256_loadu_ps(kz.data() + c), b8);
          }
          bias[r] = hsum8(b8);
#else
          v16f bacc{};
          for (int c = 0; c < D; c += 16) {
            const v16f xv = vld(x + c);
            vst(o + c, xv * vld(ks.data() + c));
            bacc += xv * vld(kz.data() + c);
          }
          bias[r] = hsum(bacc);
#endif
        }
        const uint8_t* kcodes = a.kc + tile * D * knb_packed;
        if (!k_native) { unpack_bytes(kcodes, D, G, a.kb, k8.data()); kcodes = k8.data(); }
        for (int r0 = 0; r0 < R; r0 += MAX_NR) {
          const int nr = std::min(MAX_NR, R - r0);
          kf[nr](kcodes, D, knb, qs.data() + r0 * D, D, s.data() + r0 * G, G);
        }
        for (int r = 0; r < R; ++r) {
          const int tq = r % TQ;
          float* v = s.data() + r * G;
          const v16f bv = splat(bias[r]);
          for (int i = 0; i < G; i += 16) vst(v + i, (vld(v + i) + bv) * vld(kcs.data() + i));
          const bool masked = a.mask && !tiles_open[((size_t)b * HQ + h * grp + r / TQ) * TQ + tq];
          if (p0 < lo[tq] || p1 > hi[tq] || masked) {
            for (int i = 0; i < G; ++i) {     // score order i = k * knb + jj is token jj * kper + k
              const int64_t p = p0 + (int64_t)(i % knb) * kper + i / knb;
              if (p < lo[tq] || p > hi[tq]) v[i] = NEG_INF;
              else if (masked) v[i] = apply_mask(r, p, v[i]);
            }
          }
          const float al = softmax_step(v, G, m[r], l[r]);
          live[r] = al >= 0.f;
          alpha[r] = al;
          if (al < 0.f) { zsum[r] = 0.f; continue; }
#if KVARN_AVX2_ONLY
          __m256 z8 = _mm256_setzero_ps();
          for (int i = 0; i < G; i += 8) {
            const __m256 p = _mm256_loadu_ps(v + i);
            z8 = fmadd8(p, _mm256_loadu_ps(vz.data() + i), z8);
            _mm256_storeu_ps(v + i, _mm256_mul_ps(p, _mm256_loadu_ps(vs.data() + i)));
          }
          zsum[r] = hsum8(z8);
#else
          v16f z{};
          for (int i = 0; i < G; i += 16) {
            const v16f p = vld(v + i);
            z += p * vld(vz.data() + i);
            vst(v + i, p * vld(vs.data() + i));
          }
          zsum[r] = hsum(z);
#endif
        }
        const uint8_t* vcodes = a.vc + tile * G * vnb_packed;
        if (!v_native) { unpack_bytes(vcodes, G, DV, a.vb, v8.data()); vcodes = v8.data(); }
        for (int r0 = 0; r0 < R; r0 += MAX_NR) {
          const int nr = std::min(MAX_NR, R - r0);
          vf[nr](vcodes, vnb, kper, knb, s.data() + r0 * G, G, tmp.data() + r0 * DV, DV);
        }
        for (int r = 0; r < R; ++r) {
          if (!live[r]) continue;
          float* o = acc_rot + r * DV;
          const float* t = tmp.data() + r * DV;
          const v16f al = splat(alpha[r]), z = splat(zsum[r]);
          for (int c = 0; c < DV; c += 16)
            vst(o + c, vld(o + c) * al + vld(vcs.data() + c) * (vld(t + c) + z));
          if (fused && alpha[r] != 1.f) scale_rows(acc_plain + r * DV, DV, alpha[r]);
        }
      }
    }
  });

}

// ================================================================ many queries (prefill)
// The multi-query form of run(): a task is one block of QB queries of one (batch row, kv
// head) with all grp query heads of that kv head (rows r = gi * QB + t, R = grp * QB). Each
// key block -- the sink or the tail in runs of XB slots, or one packed tile -- is made an
// fp32 block once per task (a tile dequantized with its dual scales into K^T [D, G] and
// V [G, D], in the code order of the loops above), and every row of the task goes through
// it with two register-blocked GEMM micro-kernels (scores = Q K^T, out += P V) and one
// online softmax. A tile's block holds its keys and values dequantized with both scales
// (and the softmax scale), so no row needs the decode step's per-row fold: over ~130 rows a
// task, folding per row costs more than dequantizing once, and its dot products are strict-order
// reductions that do not vectorize. Causal / window / mask visibility is applied per element only where a
// block is not wholly visible to a row, so queries inside the quantized region (a prefill
// chunk after a packed past) are exact. No splits: a task owns its rows' whole softmax.
typedef float v8f __attribute__((vector_size(32)));   // one ymm with AVX2
inline v8f vld8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
inline void vst8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline v8f splat8(float x) { return v8f{x, x, x, x, x, x, x, x}; }   // one vbroadcastss (v8f{} + x: an add first)

constexpr int MR = 6;    // rows per micro-kernel block: 12 accumulators + 2 loads + 1 broadcast
constexpr int XB = 64;   // exact-region tokens per block

// S[r][j] = sum_c Q[r][c] * Kt[c][j] for r < NR, j < n (a multiple of 16)
template <int NR>
void mq_scores(const float* Q, int D, const float* Kt, int n, float* S, int lds) {
  for (int j = 0; j < n; j += 16) {
    v8f acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = v8f{};
    const float* kp = Kt + j;
    for (int c = 0; c < D; ++c, kp += n) {
      const v8f k0 = vld8(kp), k1 = vld8(kp + 8);
#pragma GCC unroll 6
      for (int r = 0; r < NR; ++r) {
        const v8f qv = splat8(Q[r * D + c]);
        acc[r][0] += qv * k0;
        acc[r][1] += qv * k1;
      }
    }
    for (int r = 0; r < NR; ++r) {
      vst8(S + r * lds + j, acc[r][0]);
      vst8(S + r * lds + j + 8, acc[r][1]);
    }
  }
}

// O[r][c] += sum_t P[r][t] * V[t][c] for r < NR, c < D (a multiple of 16), t < n
template <int NR>
void mq_values(const float* P, int ldp, const float* V, int D, int n, float* O) {
  for (int c = 0; c < D; c += 16) {
    v8f acc[NR][2];
    for (int r = 0; r < NR; ++r) {
      acc[r][0] = vld8(O + r * D + c);
      acc[r][1] = vld8(O + r * D + c + 8);
    }
    const float* vp = V + c;
    for (int t = 0; t < n; ++t, vp += D) {
      const v8f v0 = vld8(vp), v1 = vld8(vp + 8);
#pragma GCC unroll 6
      for (int r = 0; r < NR; ++r) {
        const v8f pv = splat8(P[r * ldp + t]);
        acc[r][0] += pv * v0;
        acc[r][1] += pv * v1;
      }
    }
    for (int r = 0; r < NR; ++r) {
      vst8(O + r * D + c, acc[r][0]);
      vst8(O + r * D + c + 8, acc[r][1]);
    }
  }
}

template <int NR>
void mq_scores_at(int nr, const float* Q, int D, const float* Kt, int n, float* S, int lds) {
  if (nr == NR) mq_scores<NR>(Q, D, Kt, n, S, lds);
  else if constexpr (NR > 1) mq_scores_at<NR - 1>(nr, Q, D, Kt, n, S, lds);
}
template <int NR>
void mq_values_at(int nr, const float* P, int ldp, const float* V, int D, int n, float* O) {
  if (nr == NR) mq_values<NR>(P, ldp, V, D, n, O);
  else if constexpr (NR > 1) mq_values_at<NR - 1>(nr, P, ldp, V, D, n, O);
}
// all R rows: S = Q Kt (lds = row stride of S), O += P V (P = S)
void gemm_scores(const float* Q, int R, int D, const float* Kt, int n, float* S, int lds) {
  for (int r0 = 0; r0 < R; r0 += MR)
    mq_scores_at<MR>(std::min(MR, R - r0), Q + (int64_t)r0 * D, D, Kt, n, S + (int64_t)r0 * lds, lds);
}
void gemm_values(const float* P, int R, int ldp, const float* V, int D, int n, float* O) {
  for (int r0 = 0; r0 < R; r0 += MR)
    mq_values_at<MR>(std::min(MR, R - r0), P + (int64_t)r0 * ldp, ldp, V, D, n, O + (int64_t)r0 * D);
}

void run_chunk(const Call& a, int qb_rows) {
  // D: scores (q, keys); DV: values and output
  const int B = a.B, H = a.H, HQ = a.HQ, TQ = a.TQ, D = a.D, DV = a.DV, N = a.N, G = a.G;
  const int grp = HQ / H;
  const int QB = std::max(1, std::min(TQ, qb_rows));
  const int nqb = (TQ + QB - 1) / QB;
  const int RM = grp * QB;                        // rows of a full task
  const int knb_packed = G * a.kb / 8, vnb_packed = DV * a.vb / 8;
  const bool k_native = a.kb == 2 || a.kb == 4 || a.kb == 8;
  const bool v_native = a.vb == 2 || a.vb == 4 || a.vb == 8;
  const int kbits = k_native ? a.kb : 8, vbits = v_native ? a.vb : 8;
  const int kper = 8 / kbits, vper = 8 / vbits;
  const int knb = G / kper, vnb = DV / vper;
  const int LS = std::max(G, XB);                 // score row stride
  std::vector<int> chan(DV);                      // value-code order -> channel
  for (int i = 0; i < DV; ++i) chan[i] = (i % vnb) * vper + i / vnb;
  std::vector<int> tok(G);                        // key-code order -> token of the tile
  for (int i = 0; i < G; ++i) tok[i] = (i % knb) * kper + i / knb;
  const int64_t ntasks = (int64_t)B * H * nqb;
  std::atomic<int64_t> next{0};
  const int nthreads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), ntasks));

  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    std::vector<float> Qp((size_t)RM * D), Qr((size_t)RM * D), S((size_t)RM * LS);
    std::vector<float> Orot((size_t)RM * DV), Opl((size_t)RM * DV), m(RM), l(RM);
    std::vector<float> Kt((size_t)D * LS), V((size_t)LS * DV), ctmp(std::max(G, DV));
    std::vector<float> ks(D), kz(D), kcs(G), vs(G), vz(G), vcs(DV), qtmp(D);
    std::vector<uint8_t> k8(k_native ? 0 : (size_t)D * G), v8(v_native ? 0 : (size_t)G * DV);
    std::vector<int64_t> lo(QB), hi(QB), open_end(RM), pos(XB);
    std::vector<int> slot(XB);
    int64_t task;
    while ((task = next.fetch_add(1)) < ntasks) {
      // the last query blocks (the most keys under a causal mask) first
      const int qbi = nqb - 1 - (int)(task / ((int64_t)B * H));
      const int64_t bh = task % ((int64_t)B * H);
      const int b = bh / H, h = bh % H;
      const int t0 = qbi * QB, qn = std::min(QB, TQ - t0), R = grp * qn;
      const int64_t len = a.lengths[b];
      const int nt = (int)std::min<int64_t>(std::max<int64_t>(a.n_tiles[b], 0), N);
      // rows r = gi * qn + t: query t0 + t of query head h * grp + gi
      auto qrow = [&](int r) { return ((int64_t)b * HQ + h * grp + r / qn) * TQ + t0 + r % qn; };
      for (int r = 0; r < R; ++r) {
        const float* x = a.q + qrow(r) * D;
        std::memcpy(Qp.data() + (size_t)r * D, x, sizeof(float) * D);
        vec_mat(x, a.rot, nullptr, D, nullptr, 1.f, Qr.data() + (size_t)r * D);
      }
      std::fill(Orot.begin(), Orot.begin() + (size_t)R * DV, 0.f);
      std::fill(Opl.begin(), Opl.begin() + (size_t)R * DV, 0.f);
      std::fill(m.begin(), m.begin() + R, NEG_INF);
      std::fill(l.begin(), l.begin() + R, 0.f);
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
      // open_end[r]: the mask attends every position < open_end[r] (of this row's range)
      for (int r = 0; r < R; ++r) {
        if (!a.mask) { open_end[r] = std::numeric_limits<int64_t>::max(); continue; }
        if (r >= qn && a.msh == 0) { open_end[r] = open_end[r % qn]; continue; }
        const int64_t off = mask_off(r), end = hi[r % qn] >= len ? len : hi[r % qn] + 1;
        int64_t p = 0;
        if (a.mask_float) { const float* mf = (const float*)a.mask + off; while (p < end && mf[p * a.msm] == 0.f) ++p; }
        else { const uint8_t* mb = (const uint8_t*)a.mask + off; while (p < end && mb[p * a.msm]) ++p; }
        open_end[r] = p >= end ? std::numeric_limits<int64_t>::max() : p;
      }
      auto apply_mask = [&](int r, int64_t p, float x) -> float {
        const int64_t off = mask_off(r) + p * a.msm;
        if (a.mask_float) return x + ((const float*)a.mask)[off];
        return ((const uint8_t*)a.mask)[off] ? x : NEG_INF;
      };
      // scores of a block (positions p(i), i < n, spanning [p0, p1]) finished by
      // fold(r, row), visibility, then the online softmax; rescales the accumulators of
      // rows whose max moved
      auto softmax_block = [&](int n, int cnt, int64_t p0, int64_t p1, auto&& p_of, auto&& fold) {
        for (int r = 0; r < R; ++r) {
          const int t = r % qn;
          float* v = S.data() + (size_t)r * LS;
          fold(r, v);
          if (!(p0 >= lo[t] && p1 <= hi[t] && p1 < open_end[r])) {
            for (int i = 0; i < cnt; ++i) {
              const int64_t p = p_of(i);
              if (p < lo[t] || p > hi[t]) v[i] = NEG_INF;
              else if (a.mask && p >= open_end[r]) v[i] = apply_mask(r, p, v[i]);
            }
          }
          for (int i = cnt; i < n; ++i) v[i] = NEG_INF;
          const float al = softmax_step(v, n, m[r], l[r]);
          if (al >= 0.f && al != 1.f) {
            scale_rows(Orot.data() + (size_t)r * DV, DV, al);
            scale_rows(Opl.data() + (size_t)r * DV, DV, al);
          }
        }
      };

      // ------------------------------------------------ exact regions (sink, tail)
      const int64_t bh_row = bh;
      for (int region = 0; region < 2; ++region) {
        const bool tail = region == 1;
        const int slots = tail ? a.W : a.S;
        if (!slots) continue;
        const void* kb_ = tail ? a.tail_k : a.sink_k;
        const void* vb_ = tail ? a.tail_v : a.sink_v;
        const int64_t row0 = bh_row * slots;
        const int64_t base = a.S + (int64_t)a.n_tiles[b] * G;
        int64_t off0 = tail ? (0 - (base - a.S)) % a.W : 0;
        if (off0 < 0) off0 += a.W;
        for (int s0 = 0; s0 < slots; s0 += XB) {
          int64_t pmin, pmax;
          const int cnt = exact_slots(tail, s0, slots, XB, base, off0, a.S, a.W, len, lo_min,
                                      hi_max, pos.data(), slot.data(), pmin, pmax);
          if (!cnt) continue;
          const int n = (cnt + 15) / 16 * 16;
          for (int i = 0; i < cnt; ++i) {             // K^T [D, n] and V [n, DV], zero padded
            to_float(kb_, a.exact_dt, (row0 + slot[i]) * D, qtmp.data(), D);
            for (int c = 0; c < D; ++c) Kt[(size_t)c * n + i] = qtmp[c];
            to_float(vb_, a.exact_dt, (row0 + slot[i]) * DV, V.data() + (size_t)i * DV, DV);
          }
          for (int c = 0; c < D; ++c) std::fill(Kt.begin() + (size_t)c * n + cnt, Kt.begin() + (size_t)c * n + n, 0.f);
          std::fill(V.begin() + (size_t)cnt * DV, V.begin() + (size_t)n * DV, 0.f);
          gemm_scores(Qp.data(), R, D, Kt.data(), n, S.data(), LS);
          softmax_block(n, cnt, pmin, pmax, [&](int i) { return pos[i]; }, [&](int, float* v) {
            for (int i = 0; i < n; ++i) v[i] *= a.scale;
          });
          gemm_values(S.data(), R, LS, V.data(), DV, n, Opl.data());
        }
      }
      // ------------------------------------------------ packed tiles
      for (int j = 0; j < nt; ++j) {
        const int64_t p0 = a.S + (int64_t)j * G, p1 = p0 + G - 1;
        if (p1 < lo_min || p0 > hi_max) continue;
        const int64_t tile = bh * N + j;
        to_float(a.krs, a.scale_dt, tile * D, ks.data(), D);
        to_float(a.krz, a.scale_dt, tile * D, kz.data(), D);
        to_float_perm(a.kcs, a.scale_dt, tile * G, ctmp.data(), kcs.data(), G, kper);
        for (int i = 0; i < G; ++i) kcs[i] *= a.scale;
        to_float_perm(a.vrs, a.scale_dt, tile * G, ctmp.data(), vs.data(), G, kper);
        to_float_perm(a.vrz, a.scale_dt, tile * G, ctmp.data(), vz.data(), G, kper);
        to_float_perm(a.vcs, a.scale_dt, tile * DV, ctmp.data(), vcs.data(), DV, vper);
        // K^T [D, G] and V [G, DV] dequantized once per task (tokens in the key code order,
        // V's rows too; V's channels in the value code order), the softmax scale folded in:
        // K[c][t] = scale * cs[t] * (rs[c] * code + rz[c]), V[t][c] = cs[c] * (rs[t] * code + rz[t]);
        // the rows then need no per-row fold (its dot products are strict-order reductions)
        const uint8_t* kcodes = a.kc + tile * D * knb_packed;
        if (!k_native) { unpack_bytes(kcodes, D, G, a.kb, k8.data()); kcodes = k8.data(); }
        for (int c = 0; c < D; ++c) {
          float* kt = Kt.data() + (size_t)c * G;
          row_codes_any(kbits, kcodes + (int64_t)c * knb, knb, kt);
          const float rs = ks[c], rz = kz[c];
          for (int i = 0; i < G; ++i) kt[i] = kcs[i] * (rs * kt[i] + rz);
        }
        const uint8_t* vcodes = a.vc + tile * G * vnb_packed;
        if (!v_native) { unpack_bytes(vcodes, G, DV, a.vb, v8.data()); vcodes = v8.data(); }
        for (int i = 0; i < G; ++i) {
          float* vt = V.data() + (size_t)i * DV;
          row_codes_any(vbits, vcodes + (int64_t)tok[i] * vnb, vnb, vt);
          const float rs = vs[i], rz = vz[i];
          for (int c = 0; c < DV; ++c) vt[c] = vcs[c] * (rs * vt[c] + rz);
        }
        const float* qsrc = a.k_plain && a.k_plain[tile] ? Qp.data() : Qr.data();
        gemm_scores(qsrc, R, D, Kt.data(), G, S.data(), LS);
        softmax_block(G, G, p0, p1, [&](int i) { return p0 + tok[i]; }, [](int, float*) {});
        gemm_values(S.data(), R, LS, V.data(), DV, G, Orot.data());
      }
      // ------------------------------------------------ normalize, rotate back, write
      for (int r = 0; r < R; ++r) {
        const int64_t orow = qrow(r);
        float* o = a.out + orow * DV;
        if (!(m[r] > NEG_INF)) {
          std::fill(o, o + DV, 0.f);
          a.lse[orow] = NEG_INF;
        } else if (std::isnan(l[r])) {
          std::fill(o, o + DV, std::numeric_limits<float>::quiet_NaN());
          a.lse[orow] = std::numeric_limits<float>::quiet_NaN();
        } else {
          const float L = l[r];
          a.lse[orow] = L > 0.f ? std::log(L) + m[r] : NEG_INF;
          vec_mat(Orot.data() + (size_t)r * DV, a.rot_t, chan.data(), DV, Opl.data() + (size_t)r * DV,
                  L > 0.f ? 1.f / L : 0.f, o);
        }
      }
    }
  });
}

int64_t pick_splits(int64_t bh, int64_t units) {
  // enough tasks to balance the threads, each at least ~4 units (a unit: one tile, the sink
  // or the tail)
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t want = (8 * threads + bh - 1) / bh;
  return std::max<int64_t>(1, std::min<int64_t>(want, units / 4));
}

const void* ptr_or_null(const std::optional<torch::Tensor>& t) {
  return t.has_value() && t->defined() && t->numel() ? t->data_ptr() : nullptr;
}

void check_contig(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "kvarn CPU kernel: expected a contiguous CPU tensor for ", name);
}

}  // namespace

// Tiles and (optionally) the exact regions. Exact mode when `lengths` is given: positions,
// causal/window/mask visibility, the sink/tail, q rotation and the rotation back; otherwise
// tiles only in the rotated frame (kv_start: first visible tile token per (b, tq)).
// task_rows > 0 (exact mode only): run_chunk, the many-query path, with about that many
// query rows (query heads x queries) per task; 0: run, the decode step.
// Keys and values may have different head dims (D from q, Dv from the V column scales):
// scores run over D (q, sink_k / tail_k, K tiles, rot [D, D]), outputs over Dv (sink_v /
// tail_v, V tiles, rot_t [Dv, Dv], out [B, HQ, TQ, Dv]).
std::vector<torch::Tensor> kvarn_attention(
    std::optional<torch::Tensor> q, std::optional<torch::Tensor> q_rot, std::optional<torch::Tensor> rot,
    std::optional<torch::Tensor> rot_t,
    std::optional<torch::Tensor> sink_k, std::optional<torch::Tensor> sink_v,
    std::optional<torch::Tensor> tail_k, std::optional<torch::Tensor> tail_v,
    torch::Tensor kc, torch::Tensor krs, torch::Tensor krz, torch::Tensor kcs,
    torch::Tensor vc, torch::Tensor vrs, torch::Tensor vrz, torch::Tensor vcs,
    std::optional<torch::Tensor> lengths, torch::Tensor n_tiles, std::optional<torch::Tensor> kv_start,
    std::optional<torch::Tensor> k_plain, std::optional<torch::Tensor> mask,
    double scale, bool causal, int64_t window, int64_t kb, int64_t vb, int64_t task_rows) {
  Call a;
  const torch::Tensor& qref = q.has_value() && q->defined() ? *q : *q_rot;
  a.B = qref.size(0); a.HQ = qref.size(1); a.TQ = qref.size(2); a.D = qref.size(3);
  a.H = kc.size(1); a.N = kc.size(2); a.G = kcs.size(3); a.kb = kb; a.vb = vb;
  TORCH_CHECK(kc.dim() == 5 && vc.dim() == 5 && kcs.dim() == 4 && vcs.dim() == 4,
              "kvarn CPU kernel: expected the tile buffers of state.py");
  a.DV = vcs.size(3);   // the values' head dim (the column scales of a V tile): D, or Dv of MLA
  TORCH_CHECK(a.D % 16 == 0 && a.DV % 16 == 0 && a.G % 16 == 0 && a.HQ % a.H == 0,
              "kvarn CPU kernel: expected head dims and group size multiples of 16 and q heads a multiple of kv heads");
  TORCH_CHECK(kb == 2 || kb == 3 || kb == 4 || kb == 8, "kvarn CPU kernel: unsupported key bits ", kb);
  TORCH_CHECK(vb == 2 || vb == 3 || vb == 4 || vb == 8, "kvarn CPU kernel: unsupported value bits ", vb);
  TORCH_CHECK(kc.size(3) == a.D && kc.size(4) * 8 == a.G * kb && vc.size(3) == a.G && vc.size(4) * 8 == a.DV * vb
              && krs.numel() == kc.numel() / kc.size(4) && kcs.numel() == krs.numel() / a.D * a.G
              && vrs.numel() == vc.numel() / vc.size(4) && vcs.numel() == vrs.numel() / a.G * a.DV
              && krz.numel() == krs.numel() && vrz.numel() == vrs.numel(),
              "kvarn CPU kernel: code buffers do not match the tile geometry");
  for (auto* t : {&kc, &krs, &krz, &kcs, &vc, &vrs, &vrz, &vcs, &n_tiles}) check_contig(*t, "the tile buffers");
  a.q = (const float*)ptr_or_null(q);
  a.qrot = (const float*)ptr_or_null(q_rot);
  a.rot = (const float*)ptr_or_null(rot);
  a.rot_t = (const float*)ptr_or_null(rot_t);
  TORCH_CHECK(a.qrot || (a.q && a.rot), "kvarn CPU kernel: expected q_rot, or q and rot");
  for (auto* t : {&q, &q_rot, &rot, &rot_t})
    if (t->has_value() && (*t)->defined()) {
      check_contig(**t, "q / rotation");
      TORCH_CHECK((*t)->scalar_type() == torch::kFloat, "kvarn CPU kernel: expected fp32 queries and rotation");
    }
  // q and q_rot [B, HQ, TQ, D]; rot: the keys' [D, D]; rot_t: the values' [DV, DV] (transposed)
  if (a.q && a.qrot) TORCH_CHECK(q->sizes() == q_rot->sizes(), "kvarn CPU kernel: expected q and q_rot of one shape");
  if (a.rot) TORCH_CHECK(rot->dim() == 2 && rot->size(0) == a.D && rot->size(1) == a.D,
                         "kvarn CPU kernel: expected the keys' rotation [D, D], D = ", a.D);
  if (a.rot_t) TORCH_CHECK(rot_t->dim() == 2 && rot_t->size(0) == a.DV && rot_t->size(1) == a.DV,
                           "kvarn CPU kernel: expected the values' rotation [Dv, Dv], Dv = ", a.DV);
  a.kc = kc.data_ptr<uint8_t>(); a.vc = vc.data_ptr<uint8_t>();
  a.krs = krs.data_ptr(); a.krz = krz.data_ptr(); a.kcs = kcs.data_ptr();
  a.vrs = vrs.data_ptr(); a.vrz = vrz.data_ptr(); a.vcs = vcs.data_ptr();
  a.scale_dt = dt_of(krs);
  for (auto* t : {&krz, &kcs, &vrs, &vrz, &vcs})
    TORCH_CHECK(t->scalar_type() == krs.scalar_type(), "kvarn CPU kernel: expected one scale dtype");
  a.n_tiles = n_tiles.data_ptr<int64_t>();
  if (lengths.has_value() && lengths->defined()) {
    TORCH_CHECK(a.q != nullptr, "kvarn CPU kernel: the exact regions need the un-rotated q");
    check_contig(*lengths, "lengths");
    a.lengths = lengths->data_ptr<int64_t>();
    for (auto* t : {&sink_k, &sink_v, &tail_k, &tail_v}) check_contig(**t, "sink / tail");
    a.exact_dt = dt_of(*sink_k);
    TORCH_CHECK(sink_v->scalar_type() == sink_k->scalar_type() && tail_k->scalar_type() == sink_k->scalar_type()
                && tail_v->scalar_type() == sink_k->scalar_type(), "kvarn CPU kernel: expected one exact dtype");
    a.S = sink_k->size(2); a.W = tail_k->size(2);
    for (auto* t : {&sink_k, &sink_v, &tail_k, &tail_v})
      TORCH_CHECK((*t)->dim() == 4 && (*t)->size(0) == a.B && (*t)->size(1) == a.H,
                  "kvarn CPU kernel: expected sink / tail buffers [B, H, slots, head dim]");
    TORCH_CHECK(sink_k->size(3) == a.D && tail_k->size(3) == a.D && sink_v->size(3) == a.DV
                && tail_v->size(3) == a.DV && sink_v->size(2) == a.S && tail_v->size(2) == a.W,
                "kvarn CPU kernel: sink / tail buffers do not match the head dims (keys ", a.D,
                ", values ", a.DV, ")");
    a.sink_k = sink_k->data_ptr(); a.sink_v = sink_v->data_ptr();
    a.tail_k = tail_k->data_ptr(); a.tail_v = tail_v->data_ptr();
    if (mask.has_value() && mask->defined()) {
      const auto& mk = *mask;
      TORCH_CHECK(mk.dim() == 4 && (mk.scalar_type() == torch::kFloat || mk.scalar_type() == torch::kByte),
                  "kvarn CPU kernel: expected a 4-d fp32 or uint8 mask");
      a.mask = mk.data_ptr(); a.mask_float = mk.scalar_type() == torch::kFloat;
      a.msb = mk.stride(0); a.msh = mk.stride(1); a.msq = mk.stride(2); a.msm = mk.stride(3);
    }
  }
  if (kv_start.has_value() && kv_start->defined() && kv_start->numel()) {
    check_contig(*kv_start, "kv_start");
    a.kv_start = kv_start->data_ptr<int64_t>();
  }
  if (k_plain.has_value() && k_plain->defined() && k_plain->numel()) {
    check_contig(*k_plain, "k_plain");
    TORCH_CHECK(k_plain->scalar_type() == torch::kByte && k_plain->numel() == (int64_t)a.B * a.H * a.N,
                "kvarn CPU kernel: expected k_plain as uint8 [B, H, N]");
    TORCH_CHECK(a.q != nullptr, "kvarn CPU kernel: plain key tiles need the un-rotated q");
    a.k_plain = k_plain->data_ptr<uint8_t>();
  }
  a.scale = (float)scale; a.causal = causal; a.window = (int)window;
  int64_t units = 0;
  const int64_t* nt = a.n_tiles;
  for (int b = 0; b < a.B; ++b) units = std::max<int64_t>(units, std::min<int64_t>(std::max<int64_t>(nt[b], 0), a.N));
  units += a.lengths ? 2 : 0;
  a.splits = (int)pick_splits((int64_t)a.B * a.H, units);
  auto out = torch::empty({a.B, a.HQ, a.TQ, a.DV}, qref.options().dtype(torch::kFloat));
  auto lse = torch::empty({a.B, a.HQ, a.TQ}, qref.options().dtype(torch::kFloat));
  a.out = out.data_ptr<float>(); a.lse = lse.data_ptr<float>();
  if (task_rows > 0) {      // the multi-query path: rows per task ~ task_rows
    TORCH_CHECK(a.lengths && a.rot && a.rot_t, "kvarn CPU kernel: the multi-query path needs the exact regions and both rotations");
    const int grp = a.HQ / a.H;
    run_chunk(a, (int)std::max<int64_t>(1, (task_rows + grp - 1) / grp));
  } else {
    run(a);
  }
  return {out, lse};
}

// The whole attention from a state's flat buffer list (state.py's order: the 16 base members,
// then k_plain if the state has key frames), for the op's CPU kernel and the compiled graph's
// extern call (kernels/cpu/attention.py: attention_state): the members, bit widths, mask
// conversion and the reference's checks (queries, mask length) in one call. Returns an
// undefined tensor (None) where this kernel does not read the state (fp8 scales, other bit
// widths, dtypes or head dims): the caller runs the reference. task_rows: the multi-query
// path's rows per task, taken for more than max_decode_queries queries.
torch::Tensor kvarn_attention_state(torch::Tensor q, std::vector<torch::Tensor> b,
                                    std::optional<torch::Tensor> mask, torch::Tensor rot,
                                    torch::Tensor rot_t, double scale, bool causal, int64_t window,
                                    int64_t task_rows, int64_t max_decode_queries) {
  using namespace kvarn;
  if (b.size() != N_BASE && b.size() != N_BASE + 1) return {};   // no fp8 factors; k_plain last
  const auto& sink_k = b[SINK_K];
  const auto &kc = b[K_CODES], &kcs = b[K_COL_SCALE], &vc = b[V_CODES], &vcs = b[V_COL_SCALE];
  const auto& lengths = b[LENGTHS];
  if (kc.dim() != 5 || vc.dim() != 5 || kcs.dim() != 4 || vcs.dim() != 4 || sink_k.dim() != 4) return {};
  const int64_t kb = 8 * kc.size(4) / kcs.size(3), vb = 8 * vc.size(4) / vcs.size(3);
  const int64_t D = sink_k.size(3), DV = vcs.size(3);
  auto readable = [](at::ScalarType t) { return t == torch::kHalf || t == torch::kBFloat16 || t == torch::kFloat; };
  auto bits_ok = [](int64_t x) { return x == 2 || x == 3 || x == 4 || x == 8; };
  if (!bits_ok(kb) || !bits_ok(vb) || D % 16 || DV % 16 || D <= 0 || DV <= 0
      || !readable(b[K_ROW_SCALE].scalar_type()) || !readable(sink_k.scalar_type())) return {};
  const int64_t B = sink_k.size(0), H = sink_k.size(1);
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(0) == B && q.size(3) == D && q.size(1) % H == 0,
                    "KVarN attention: expected queries [batch=", B, ", heads=k*", H, ", tq, head_dim=", D,
                    "], but got ", q.sizes(), ".");
  std::optional<torch::Tensor> m;
  if (mask.has_value() && mask->defined()) {
    int64_t held = 0;
    const auto len = lengths.contiguous();
    const int64_t* lp = len.data_ptr<int64_t>();
    for (int64_t i = 0; i < len.numel(); ++i) held = std::max(held, lp[i]);
    TORCH_CHECK_VALUE(mask->size(-1) >= held, "KVarN attention: the mask covers ", mask->size(-1),
                      " key positions, but the cache holds up to ", held, "; expected a mask as long as the cache.");
    const auto mk = mask->scalar_type() == torch::kBool ? mask->view(torch::kByte) : mask->to(torch::kFloat);
    m = mk.expand({B, q.size(1), q.size(2), mk.size(-1)});
  }
  std::optional<torch::Tensor> k_plain;
  if (b.size() == N_BASE + 1) k_plain = b[N_BASE].to(torch::kByte).contiguous();
  auto c = [&b](int i) { return b[i].contiguous(); };
  const auto q32 = q.to(torch::kFloat).contiguous();
  auto out = kvarn_attention(q32, std::nullopt, rot, rot_t, c(SINK_K), c(SINK_V), c(TAIL_K), c(TAIL_V),
                             c(K_CODES), c(K_ROW_SCALE), c(K_ROW_ZERO), c(K_COL_SCALE), c(V_CODES),
                             c(V_ROW_SCALE), c(V_ROW_ZERO), c(V_COL_SCALE), c(LENGTHS), c(N_TILES),
                             std::nullopt, k_plain, m, scale, causal, window, kb, vb,
                             q.size(2) > max_decode_queries ? task_rows : 0)[0];
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

std::vector<std::string> kvarn_state_members() {
  return {std::begin(kvarn::MEMBER_NAMES), std::end(kvarn::MEMBER_NAMES)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kvarn_state_members", &kvarn_state_members, "kvarn_state_members");
  m.def("kvarn_attention_state", torch::wrap_pybind_function(kvarn_attention_state), "kvarn_attention_state");
  m.def("kvarn_attention", torch::wrap_pybind_function(kvarn_attention), "kvarn_attention");
  m.def("kvarn_latent_attention_state", torch::wrap_pybind_function(kvarn_latent_attention_state),
        "kvarn_latent_attention_state");
  m.def("kvarn_append_decode", torch::wrap_pybind_function(kvarn_append_decode), "kvarn_append_decode");
  m.def("kvarn_register_native_ops", torch::wrap_pybind_function(kvarn_register_native_ops),
        "kvarn_register_native_ops");
  m.def("kvarn_note_released", torch::wrap_pybind_function(kvarn_note_released), "kvarn_note_released");
}
