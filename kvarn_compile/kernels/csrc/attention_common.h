// Shared by the attention kernels of the "attention" extension (attention.cpp: kvarn::attention,
// latent_attention.cpp: kvarn::latent_attention): 16-lane vectors and their exp, the storage
// dtype conversions, code unpacking and the online softmax step. Each file that includes it
// gets its own internal copy (an anonymous namespace); the definitions are attention.cpp's,
// moved here unchanged.
#pragma once

#include "kvarn_common.h"

#include <limits>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// 16-lane vectors (GCC/Clang vector extensions: one zmm with AVX-512, two ymm with AVX2).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline v16f vld(const float* p) { v16f v; std::memcpy(&v, p, sizeof v); return v; }
inline void vst(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
inline v16f splat(float x) { return v16f{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }   // (v16f{} + x: an add per lane group, then a broadcast)
#if defined(__AVX512F__)
inline float hsum(v16f v) { return _mm512_reduce_add_ps((__m512)v); }
inline float hmax(v16f v) { return _mm512_reduce_max_ps((__m512)v); }
#else
inline float hsum(v16f v) {   // tree: a sequential sum is one long dependency chain
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) t[i] += t[i + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}
inline float hmax(v16f v) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = std::max(v[i], v[i + 8]);
  for (int i = 0; i < 4; ++i) t[i] = std::max(t[i], t[i + 4]);
  return std::max(std::max(t[0], t[2]), std::max(t[1], t[3]));
}
#endif

// exp on 16 lanes: 2^n * e^r, n = round(x / ln 2), |r| <= ln2 / 2, degree-7 Taylor (rel. err
// < 1e-7). Results below 2^-126 flush to 0 (exp(-inf) = 0); NaN propagates.
inline v16f vexp(v16f x) {
  const v16f lo = splat(-87.33654475f), hi = splat(88.3762626647949f);
  const v16i dead = x < lo;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const v16f magic = splat(12582912.f);                 // 1.5 * 2^23: round to nearest
  const v16f n = (x * splat(1.44269504088896341f) + magic) - magic;
  v16f r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  v16f p = splat(1.f / 5040.f);
  p = p * r + splat(1.f / 720.f);
  p = p * r + splat(1.f / 120.f);
  p = p * r + splat(1.f / 24.f);
  p = p * r + splat(1.f / 6.f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.f);
  p = p * r + splat(1.f);
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  const v16f out = p * (v16f)e;
  return dead ? v16f{} : out;
}

// ---------------------------------------------------------------- dtype conversion
enum Dt { F32 = 0, F16 = 1, BF16 = 2 };

int dt_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return F32;
    case torch::kHalf: return F16;
    case torch::kBFloat16: return BF16;
    default: TORCH_CHECK(false, "kvarn CPU kernel: expected fp32/fp16/bf16, but got ", t.scalar_type());
  }
  return F32;
}

// dst[i] = float(src[off + i]), i < n
void to_float(const void* src, int dt, int64_t off, float* dst, int n) {
  if (dt == F32) { std::memcpy(dst, (const float*)src + off, sizeof(float) * n); return; }
  const uint16_t* s = (const uint16_t*)src + off;
  if (dt == BF16) {
    for (int i = 0; i < n; ++i) { uint32_t u = (uint32_t)s[i] << 16; std::memcpy(dst + i, &u, 4); }
    return;
  }
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + i))));
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(s[i], c10::Half::from_bits()));
}

// dst[(t % per) * (n / per) + t / per] = float(src[off + t]): the order the unpacked codes
// of a row come out in (all codes at shift 0 first, then shift 1, ...).
void to_float_perm(const void* src, int dt, int64_t off, float* tmp, float* dst, int n, int per) {
  if (per == 1) { to_float(src, dt, off, dst, n); return; }
  to_float(src, dt, off, tmp, n);
  const int nb = n / per;
#if defined(__AVX512F__)
  if (nb % 16 == 0 && (per == 2 || per == 4)) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int j = 0; j < nb; j += 16) {
      const float* x = tmp + j * per;
      if (per == 2) {
        const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
        _mm512_storeu_ps(dst + j, _mm512_permutex2var_ps(a, ev, b));
        _mm512_storeu_ps(dst + nb + j, _mm512_permutex2var_ps(a, od, b));
      } else {    // t % 4: split by t % 2, then each half by (t / 2) % 2
        const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
        const __m512 c = _mm512_loadu_ps(x + 32), d = _mm512_loadu_ps(x + 48);
        const __m512 e0 = _mm512_permutex2var_ps(a, ev, b), o0 = _mm512_permutex2var_ps(a, od, b);
        const __m512 e1 = _mm512_permutex2var_ps(c, ev, d), o1 = _mm512_permutex2var_ps(c, od, d);
        _mm512_storeu_ps(dst + j, _mm512_permutex2var_ps(e0, ev, e1));            // t % 4 == 0
        _mm512_storeu_ps(dst + 2 * nb + j, _mm512_permutex2var_ps(e0, od, e1));   // t % 4 == 2
        _mm512_storeu_ps(dst + nb + j, _mm512_permutex2var_ps(o0, ev, o1));       // t % 4 == 1
        _mm512_storeu_ps(dst + 3 * nb + j, _mm512_permutex2var_ps(o0, od, o1));   // t % 4 == 3
      }
    }
    return;
  }
#endif
  for (int k = 0; k < per; ++k)
    for (int j = 0; j < nb; ++j) dst[k * nb + j] = tmp[j * per + k];
}

// Unpack `rows` packed rows of `cols` codes (any supported width: 2/3/4/8) to one byte per
// code in natural order (the generic path for widths/row sizes the vector loops skip).
void unpack_bytes(const uint8_t* src, int rows, int cols, int bits, uint8_t* dst) {
  const int mask = (1 << bits) - 1;
  const int rb = cols * bits / 8;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* s = src + (int64_t)r * rb;
    uint8_t* d = dst + (int64_t)r * cols;
    if (bits == 3) {
      for (int g = 0; g < cols / 8; ++g) {
        const uint32_t w = s[3 * g] | ((uint32_t)s[3 * g + 1] << 8) | ((uint32_t)s[3 * g + 2] << 16);
        for (int i = 0; i < 8; ++i) d[8 * g + i] = (w >> (3 * i)) & 7;
      }
    } else {
      const int per = 8 / bits;
      for (int i = 0; i < cols; ++i) d[i] = (s[i / per] >> ((i % per) * bits)) & mask;
    }
  }
}

// ---------------------------------------------------------------- AVX2 helpers
// KVARN_AVX2_ONLY: AVX2 without AVX-512, where the kernels use native 8-lane forms of their
// loops (GCC lowers 16-lane vector extensions to stack spills there).
#if defined(__AVX2__) && !defined(__AVX512F__)
#define KVARN_AVX2_ONLY 1
inline __m256 fmadd8(__m256 a, __m256 b, __m256 c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}
#else
#define KVARN_AVX2_ONLY 0
#endif

// ---------------------------------------------------------------- online softmax
// v: n (multiple of 16) scaled scores of one row, -inf where hidden. Turns v into
// exp(v - m_new), updates (m, l); returns alpha = exp(m_old - m_new), or -1 when the
// block hides every position (then v is zeroed and m, l are unchanged). A NaN score (a
// visible NaN key) poisons the row like it does the reference's softmax: l becomes NaN
// (and m finite) for good, and the merge writes NaN.
#if KVARN_AVX2_ONLY
inline float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}
inline float hmax8(__m256 v) {
  const __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_shuffle_ps(b, b, 1)));
}
// vexp on 8 lanes (the same approximation; min/max operand order keeps NaN)
inline __m256 vexp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654475f), hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, _mm256_min_ps(hi, x));
  const __m256 magic = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(fmadd8(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
  __m256 r = fmadd8(n, _mm256_set1_ps(-0.693359375f), x);
  r = fmadd8(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = fmadd8(p, r, _mm256_set1_ps(1.f / 720.f));
  p = fmadd8(p, r, _mm256_set1_ps(1.f / 120.f));
  p = fmadd8(p, r, _mm256_set1_ps(1.f / 24.f));
  p = fmadd8(p, r, _mm256_set1_ps(1.f / 6.f));
  p = fmadd8(p, r, _mm256_set1_ps(0.5f));
  p = fmadd8(p, r, _mm256_set1_ps(1.f));
  p = fmadd8(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

inline float softmax_step(float* v, int n, float& m, float& l) {
#if KVARN_AVX2_ONLY
  __m256 mx8 = _mm256_set1_ps(NEG_INF), nan8 = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    mx8 = _mm256_max_ps(x, mx8);                              // a NaN x keeps mx8
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan8) || std::isnan(l)) {
    if (!(m > NEG_INF)) m = 0.f;
    l = std::numeric_limits<float>::quiet_NaN();
    std::memset(v, 0, sizeof(float) * n);
    return 1.f;
  }
  const float peak8 = hmax8(mx8);
  if (!(peak8 > NEG_INF)) { std::memset(v, 0, sizeof(float) * n); return -1.f; }
  const float m_new8 = std::max(m, peak8);
  const float alpha8 = std::exp(m - m_new8);
  const __m256 mv8 = _mm256_set1_ps(m_new8);
  __m256 ps8 = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    const __m256 p = vexp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), mv8));
    _mm256_storeu_ps(v + i, p);
    ps8 = _mm256_add_ps(ps8, p);
  }
  l = l * alpha8 + hsum8(ps8);
  m = m_new8;
  return alpha8;
#endif
  v16f mx = splat(NEG_INF);
  v16i nan{};
  for (int i = 0; i < n; i += 16) {
    const v16f x = vld(v + i);
    mx = x > mx ? x : mx;
    nan |= x != x;
  }
  bool poisoned = false;
  for (int i = 0; i < 16; ++i) poisoned |= nan[i] != 0;
  if (poisoned || std::isnan(l)) {
    if (!(m > NEG_INF)) m = 0.f;
    l = std::numeric_limits<float>::quiet_NaN();
    std::memset(v, 0, sizeof(float) * n);
    return 1.f;
  }
  const float peak = hmax(mx);
  if (!(peak > NEG_INF)) { std::memset(v, 0, sizeof(float) * n); return -1.f; }
  const float m_new = std::max(m, peak);
  const float alpha = std::exp(m - m_new);
  const v16f mv = splat(m_new);
  v16f ps{};
  for (int i = 0; i < n; i += 16) { const v16f p = vexp(vld(v + i) - mv); vst(v + i, p); ps += p; }
  l = l * alpha + hsum(ps);
  m = m_new;
  return alpha;
}

inline void scale_rows(float* a, int d, float alpha) {
  if (alpha == 1.f) return;
  for (int c = 0; c < d; ++c) a[c] *= alpha;
}

// One packed row of `nbytes` bytes of BITS-bit codes as floats in the loops' code order:
// out[k * nbytes + j] = code j * PER + k (8-bit: natural order).
template <int BITS>
inline void row_codes(const uint8_t* p, int nbytes, float* out) {
  constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
  for (int k = 0; k < PER; ++k) {
    float* o = out + k * nbytes;
    for (int j = 0; j < nbytes; ++j) o[j] = (float)((p[j] >> (k * BITS)) & MASK);
  }
}
inline void row_codes_any(int bits, const uint8_t* p, int nbytes, float* out) {
  if (bits == 2) row_codes<2>(p, nbytes, out);
  else if (bits == 4) row_codes<4>(p, nbytes, out);
  else row_codes<8>(p, nbytes, out);
}

}  // namespace

// The exact-region slots among [s0, min(slots, s0 + block)) that hold a token some query of
// the task may see (lo_min <= position <= hi_max): their positions and slots in order, and
// the range of those positions (pmin > pmax when none). Sink (tail false): slot sl holds
// position sl. Tail ring: slot sl holds position base + (sl - (base - S)) mod W, with off0
// that offset at slot 0 and base the first tail position. Returns how many.
inline int exact_slots(bool tail, int s0, int slots, int block, int64_t base, int64_t off0,
                       int64_t S, int64_t W, int64_t len, int64_t lo_min, int64_t hi_max,
                       int64_t* pos, int* slot, int64_t& pmin, int64_t& pmax) {
  int cnt = 0;
  int64_t off = tail ? (off0 + s0) % W : 0;
  pmin = std::numeric_limits<int64_t>::max();
  pmax = -1;
  for (int sl = s0; sl < std::min(slots, s0 + block); ++sl) {
    int64_t p;
    bool ok;
    if (tail) { p = base + off; if (++off == W) off = 0; ok = p < len && len > S; }
    else { p = sl; ok = p < len; }
    if (!ok || p < lo_min || p > hi_max) continue;
    pos[cnt] = p; slot[cnt] = sl; ++cnt;
    pmin = std::min(pmin, p); pmax = std::max(pmax, p);
  }
  return cnt;
}
