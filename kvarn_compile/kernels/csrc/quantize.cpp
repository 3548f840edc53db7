// The KVarN tile quantizer, bit-identical to the reference (kernels/cpu/quantize.py is its
// launcher and lists what "the same operations" means: float64 left-to-right sums, IEEE
// division and sqrt, round-half-to-even, torch's storage casts). Built by
// kernels/cpu/build.py with -O3 -march=native -ffp-contract=off -fno-fast-math -fopenmp
// (no fused multiply-add: every product rounds as in torch); one extension, this file.
#include "kvarn_common.h"

namespace {

// Constants of the reference (quant/quantize.py), passed from Python so they never drift.
struct Consts {
  double std_lo, std_hi;      // STD_CLIP
  double scale_lo, scale_hi;  // SCALE_CLIP = e^LOG_SCALE_CLIP
  double imb_eps;             // IMBALANCE_EPS
  float delta_min;            // DELTA_MIN (torch casts the scalar to the fp32 tensor's dtype)
  float dominance;            // DOMINANCE_THRESHOLD
  float tiny;                 // finfo(float32).tiny
  int clip_max_bits;          // CLIP_MAX_BITS
  std::vector<float> ratios;  // CLIP_RATIOS, each cast to fp32 as torch does in `a * half`
};

Consts make_consts(const std::vector<double>& c, const std::vector<double>& ratios) {
  TORCH_CHECK(c.size() == 9, "kvarn_quantize: expected 9 constants");
  Consts k;
  k.std_lo = c[0]; k.std_hi = c[1]; k.scale_lo = c[2]; k.scale_hi = c[3]; k.imb_eps = c[4];
  k.delta_min = (float)c[5]; k.dominance = (float)c[6]; k.tiny = (float)c[7];
  k.clip_max_bits = (int)c[8];
  for (double r : ratios) k.ratios.push_back((float)r);
  return k;
}

// Column stds of a row-major [R, C] fp32 matrix, float64: out[c] = sqrt(sum_r (y - m)^2 /
// (R - 1)), m = sum_r y / R; every sum starts at 0 and runs over r in order (what torch's
// cumsum does). The lanes are the columns: the inner loop vectorizes, no sum is reordered.
inline void col_std(const float* __restrict__ y, int R, int C, double* __restrict__ out,
                    double* __restrict__ acc) {
  for (int c = 0; c < C; ++c) acc[c] = 0.0;
  for (int r = 0; r < R; ++r) {
    const float* __restrict__ yr = y + (size_t)r * C;
    for (int c = 0; c < C; ++c) acc[c] += (double)yr[c];
  }
  for (int c = 0; c < C; ++c) out[c] = acc[c] / (double)R;
  for (int c = 0; c < C; ++c) acc[c] = 0.0;
  for (int r = 0; r < R; ++r) {
    const float* __restrict__ yr = y + (size_t)r * C;
    for (int c = 0; c < C; ++c) {
      const double d = (double)yr[c] - out[c];
      acc[c] += d * d;
    }
  }
  for (int c = 0; c < C; ++c) out[c] = std::sqrt(acc[c] / (double)(R - 1));
}

// y[r, c] = (x[r, c] / cf[c]) / rf[r] on [R, C] (the reference's x / c / r, fp32).
inline void scale_rows(const float* __restrict__ x, int R, int C, const float* __restrict__ cf,
                       const float* __restrict__ rf, float* __restrict__ y) {
  for (int r = 0; r < R; ++r) {
    const float rv = rf[r];
    const float* __restrict__ xr = x + (size_t)r * C;
    float* __restrict__ yr = y + (size_t)r * C;
    for (int c = 0; c < C; ++c) yr[c] = (xr[c] / cf[c]) / rv;
  }
}

// The same values in the transposed layout: yt[c, r] = (xt[c, r] / cf[c]) / rf[r].
inline void scale_cols(const float* __restrict__ xt, int R, int C, const float* __restrict__ cf,
                       const float* __restrict__ rf, float* __restrict__ yt) {
  for (int c = 0; c < C; ++c) {
    const float cv = cf[c];
    const float* __restrict__ xc = xt + (size_t)c * R;
    float* __restrict__ yc = yt + (size_t)c * R;
    for (int r = 0; r < R; ++r) yc[r] = (xc[r] / cv) / rf[r];
  }
}

inline double imbalance(const double* col, int C, const double* row, int R, double eps) {
  double cmax = col[0], cmin = col[0], rmax = row[0], rmin = row[0];
  for (int c = 1; c < C; ++c) { cmax = std::max(cmax, col[c]); cmin = std::min(cmin, col[c]); }
  for (int r = 1; r < R; ++r) { rmax = std::max(rmax, row[r]); rmin = std::min(rmin, row[r]); }
  return cmax / std::max(cmin, eps) + rmax / std::max(rmin, eps);
}

inline double clampd(double v, double lo, double hi) { return std::min(std::max(v, lo), hi); }

template <typename S> inline S to_store(float v) { return S(v); }
template <> inline float to_store<float>(float v) { return v; }

struct Scratch {
  std::vector<float> X, Y, YT, cf, rf, rng, lo, hi, delta, mid, half, lo_a, delta_a;
  std::vector<double> colstd, rowstd, c, r, best_c, best_r, acc, best_err, err;
  std::vector<uint8_t> codes, codes_t;
  void init(int R, int C) {
    const size_t n = (size_t)R * C;
    X.resize(n); Y.resize(n); YT.resize(n); codes_t.resize(n);
    cf.resize(C); rf.resize(R); rng.resize(std::max(R, C));
    for (auto* v : {&lo, &hi, &delta, &mid, &half, &lo_a, &delta_a}) v->resize(R);
    colstd.resize(C); rowstd.resize(R); c.resize(C); r.resize(R); best_c.resize(C);
    best_r.resize(R); acc.resize(std::max(R, C)); best_err.resize(R); err.resize(R);
    codes.resize(C);
  }
};

// One job: the tiles of one kind (K or V) of [L, T, D] token-major tokens.
struct Job {
  const float* rot = nullptr;    // [L, T, D] rotated tokens (null: no rotation)
  const float* plain = nullptr;  // [L, T, D] un-rotated fp32 tokens
  int L = 0, n = 0, G = 0, D = 0;
  bool is_k = true, normalize = false, clip = false, auto_frame = false;
  int bits = 4, iters = 0;
  at::ScalarType st = at::kHalf;
  uint8_t* codes = nullptr;      // [L, n, R, C*bits/8]
  void* rs = nullptr;            // [L, n, R]
  void* rz = nullptr;            // [L, n, R]
  void* cs = nullptr;            // [L, n, C]
  uint8_t* plain_out = nullptr;  // [L, n] (auto_frame)
  int R() const { return is_k ? D : G; }
  int C() const { return is_k ? G : D; }
  int units() const { return L * n; }
};

// code = clamp(round_half_to_even((b - lo) / delta), 0, qmax) (torch.round is nearbyint)
inline float rne_code(float b, float lo, float delta, float qmax) {
  return std::min(std::max(std::nearbyint((b - lo) / delta), 0.0f), qmax);
}

// float64 squared rounding error of every row of B, from B^T [C, R] (lanes: rows), each sum
// from 0 left to right over the columns (reference _sq_err): e = (code * delta + lo) - b.
inline void sq_err(const float* __restrict__ bt, int R, int C, const float* __restrict__ lo,
                   const float* __restrict__ delta, float qmax, double* __restrict__ out) {
  for (int i = 0; i < R; ++i) out[i] = 0.0;
  for (int j = 0; j < C; ++j) {
    const float* __restrict__ bj = bt + (size_t)j * R;
    for (int i = 0; i < R; ++i) {
      const float q = rne_code(bj[i], lo[i], delta[i], qmax);
      const double e = (double)((q * delta[i] + lo[i]) - bj[i]);
      out[i] += e * e;
    }
  }
}

inline void pack_row(const uint8_t* codes, int C, int bits, uint8_t* out) {
  if (bits == 8) { std::memcpy(out, codes, C); return; }
  if (bits == 3) {   // 8 codes -> 3 bytes, little end first
    for (int g = 0; g < C / 8; ++g) {
      uint32_t w = 0;
      for (int i = 0; i < 8; ++i) w |= (uint32_t)codes[g * 8 + i] << (3 * i);
      out[3 * g] = w & 0xFF; out[3 * g + 1] = (w >> 8) & 0xFF; out[3 * g + 2] = (w >> 16) & 0xFF;
    }
    return;
  }
  const int per = 8 / bits;
  for (int g = 0; g < C / per; ++g) {
    uint32_t w = 0;
    for (int i = 0; i < per; ++i) w |= (uint32_t)codes[g * per + i] << (bits * i);
    out[g] = (uint8_t)w;
  }
}

// max |k| / median channel range >= threshold on one token-major [G, D] tile (choose_key_frame).
inline bool dominated(const float* t, int G, int D, const Consts& k, float* rng) {
  float peak = 0.0f;
  for (int d = 0; d < D; ++d) {
    float mx = t[d], mn = t[d];
    for (int g = 1; g < G; ++g) { const float v = t[(size_t)g * D + d]; mx = std::max(mx, v); mn = std::min(mn, v); }
    rng[d] = mx - mn;
  }
  for (size_t i = 0; i < (size_t)G * D; ++i) peak = std::max(peak, std::fabs(t[i]));
  std::nth_element(rng, rng + D / 2, rng + D);
  const float median = std::max(rng[D / 2], k.tiny);
  return peak / median >= k.dominance;
}

template <typename S>
void quantize_tile(const Job& job, int unit, const Consts& k, Scratch& s,
                   std::atomic<int>& nonfinite, std::atomic<int>& overflow) {
  const int R = job.R(), C = job.C(), G = job.G, D = job.D;
  const int T = job.n * G;
  const int l = unit / job.n, j = unit % job.n;
  const size_t off = ((size_t)l * T + (size_t)j * G) * D;
  const float* plain = job.plain + off;
  const float* src = job.rot ? job.rot + off : plain;
  for (size_t i = 0; i < (size_t)G * D; ++i)
    if (!std::isfinite(plain[i]) || !std::isfinite(src[i])) { nonfinite.store(1); return; }
  bool normalize = job.normalize && job.iters > 0;
  if (job.auto_frame) {
    const bool p = dominated(plain, G, D, k, s.rng.data());
    job.plain_out[unit] = p ? 1 : 0;
    if (p) { src = plain; normalize = false; }
  }
  // X [R, C] and XT [C, R] (the same values transposed); the token-major src [G, D] is XT for
  // K tiles and X for V tiles. X is read by the normalization only.
  const float* X = src;
  const float* XT = src;
  float* tr = s.X.data();
  if (job.is_k ? normalize : true) {
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) tr[(size_t)d * G + g] = src[(size_t)g * D + d];
    if (job.is_k) X = tr; else XT = tr;
  }

  float* cf = s.cf.data(); float* rf = s.rf.data();
  for (int c = 0; c < C; ++c) cf[c] = 1.0f;
  for (int r = 0; r < R; ++r) rf[r] = 1.0f;
  if (normalize) {
    double* colstd = s.colstd.data(); double* rowstd = s.rowstd.data(); double* acc = s.acc.data();
    double* c = s.c.data(); double* r = s.r.data();
    double* best_c = s.best_c.data(); double* best_r = s.best_r.data();
    for (int i = 0; i < C; ++i) c[i] = best_c[i] = 1.0;
    for (int i = 0; i < R; ++i) r[i] = best_r[i] = 1.0;
    col_std(X, R, C, colstd, acc);
    col_std(XT, C, R, rowstd, acc);
    double best = imbalance(colstd, C, rowstd, R, k.imb_eps);
    float* Y = s.Y.data(); float* YT = s.YT.data();
    for (int it = 0; it < job.iters; ++it) {
      for (int i = 0; i < C; ++i) {
        c[i] = clampd(c[i] * clampd(colstd[i], k.std_lo, k.std_hi), k.scale_lo, k.scale_hi);
        cf[i] = (float)c[i];
      }
      scale_cols(XT, R, C, cf, rf, YT);
      col_std(YT, C, R, rowstd, acc);
      for (int i = 0; i < R; ++i) {
        r[i] = clampd(r[i] * clampd(rowstd[i], k.std_lo, k.std_hi), k.scale_lo, k.scale_hi);
        rf[i] = (float)r[i];
      }
      scale_rows(X, R, C, cf, rf, Y);
      scale_cols(XT, R, C, cf, rf, YT);
      col_std(Y, R, C, colstd, acc);
      col_std(YT, C, R, rowstd, acc);
      const double score = imbalance(colstd, C, rowstd, R, k.imb_eps);
      if (score <= best) {
        best = score;
        std::memcpy(best_c, c, sizeof(double) * C);
        std::memcpy(best_r, r, sizeof(double) * R);
      }
    }
    for (int i = 0; i < C; ++i) cf[i] = (float)best_c[i];
    for (int i = 0; i < R; ++i) rf[i] = (float)best_r[i];
  }
  // RTN per row of B = (X / c*) / r*, computed on B^T [C, R] so that the lanes are the rows
  // (every per-row sum stays left to right over the columns); fold, store, pack.
  const float* BT = XT;                          // x / 1 / 1 = x exactly
  if (normalize) {
    scale_cols(XT, R, C, cf, rf, s.Y.data());
    BT = s.Y.data();
  }
  const float qmax = (float)((1 << job.bits) - 1);
  const float dmin = k.delta_min;
  float* lo = s.lo.data(); float* hi = s.hi.data(); float* delta = s.delta.data();
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = BT[i];
  for (int j = 1; j < C; ++j) {
    const float* __restrict__ bj = BT + (size_t)j * R;
    for (int i = 0; i < R; ++i) { lo[i] = std::min(lo[i], bj[i]); hi[i] = std::max(hi[i], bj[i]); }
  }
  for (int i = 0; i < R; ++i) delta[i] = std::max((hi[i] - lo[i]) / qmax, dmin);
  if (job.clip && job.bits <= k.clip_max_bits) {
    float* mid = s.mid.data(); float* half = s.half.data();
    float* lo_a = s.lo_a.data(); float* delta_a = s.delta_a.data();
    double* best = s.best_err.data(); double* err = s.err.data();
    for (int i = 0; i < R; ++i) { mid[i] = (lo[i] + hi[i]) / 2.0f; half[i] = (hi[i] - lo[i]) / 2.0f; }
    sq_err(BT, R, C, lo, delta, qmax, best);
    for (size_t a = 1; a < k.ratios.size(); ++a) {
      const float ra = k.ratios[a];
      for (int i = 0; i < R; ++i) {
        lo_a[i] = mid[i] - ra * half[i];
        const float hi_a = mid[i] + ra * half[i];
        delta_a[i] = std::max((hi_a - lo_a[i]) / qmax, dmin);
      }
      sq_err(BT, R, C, lo_a, delta_a, qmax, err);
      for (int i = 0; i < R; ++i)
        if (err[i] < best[i]) { best[i] = err[i]; lo[i] = lo_a[i]; delta[i] = delta_a[i]; }
    }
  }
  uint8_t* codes_t = s.codes_t.data();           // [C, R]
  for (int j = 0; j < C; ++j) {
    const float* __restrict__ bj = BT + (size_t)j * R;
    uint8_t* __restrict__ cj = codes_t + (size_t)j * R;
    for (int i = 0; i < R; ++i) cj[i] = (uint8_t)rne_code(bj[i], lo[i], delta[i], qmax);
  }
  const int row_bytes = C * job.bits / 8;
  uint8_t* codes_out = job.codes + (size_t)unit * R * row_bytes;
  S* rs = (S*)job.rs + (size_t)unit * R;
  S* rz = (S*)job.rz + (size_t)unit * R;
  S* cs = (S*)job.cs + (size_t)unit * C;
  uint8_t* row = s.codes.data();
  bool inf = false;
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < C; ++j) row[j] = codes_t[(size_t)j * R + i];
    pack_row(row, C, job.bits, codes_out + (size_t)i * row_bytes);
    const S sv = to_store<S>(rf[i] * delta[i]), zv = to_store<S>(rf[i] * lo[i]);
    inf |= std::isinf((float)sv) || std::isinf((float)zv);
    rs[i] = sv; rz[i] = zv;
  }
  for (int i = 0; i < C; ++i) {
    const S v = to_store<S>(cf[i]);
    inf |= std::isinf((float)v);
    cs[i] = v;
  }
  if (inf) overflow.store(1);
}

// Returns flags: 1 = a non-finite input value (outputs incomplete), 2 = a stored scale is inf.
int run_jobs(std::vector<Job>& jobs, const Consts& k) {
  std::atomic<int> nonfinite{0}, overflow{0};
  int64_t total = 0;
  for (auto& j : jobs) total += j.units();
  if (total == 0) return 0;
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    int sized_r = -1, sized_c = -1;
    for (int64_t u = begin; u < end; ++u) {
      if (nonfinite.load(std::memory_order_relaxed)) return;
      int64_t rest = u;
      size_t ji = 0;
      while (rest >= jobs[ji].units()) { rest -= jobs[ji].units(); ++ji; }
      const Job& job = jobs[ji];
      if (job.R() != sized_r || job.C() != sized_c) {
        s.init(job.R(), job.C());
        sized_r = job.R(); sized_c = job.C();
      }
      kvarn::with_storage_type(job.st, [&](auto tag) {
        quantize_tile<decltype(tag)>(job, (int)rest, k, s, nonfinite, overflow);
      });
    }
  });
  return (nonfinite.load() ? 1 : 0) | (overflow.load() ? 2 : 0);
}

struct Prepared {
  at::Tensor rot, plain;   // [L, T, D] contiguous fp32 (rot undefined without rotation)
  int64_t L, T, D;
};

// x [..., T, D] in any float dtype; the rotation is the reference's `x.float() @ H` on x's shape.
Prepared prepare(const at::Tensor& x, const std::optional<at::Tensor>& rot) {
  TORCH_CHECK(x.dim() >= 2, "kvarn_quantize: expected x of shape [..., T, D]");
  Prepared p;
  at::Tensor xf = x.to(at::kFloat);
  p.D = x.size(-1); p.T = x.size(-2);
  p.L = p.T * p.D ? x.numel() / (p.T * p.D) : 0;
  if (rot.has_value()) p.rot = at::matmul(xf, *rot).contiguous().view({p.L, p.T, p.D});
  p.plain = xf.contiguous().view({p.L, p.T, p.D});
  return p;
}

at::ScalarType scale_type(int64_t code) {
  switch (code) {
    case 0: return at::kHalf;
    case 1: return at::kBFloat16;
    case 2: return at::kFloat;
  }
  TORCH_CHECK(false, "kvarn_quantize: unknown scale dtype code ", code);
}

Job make_job(const Prepared& p, bool is_k, int64_t bits, int64_t group, bool normalize,
             int64_t iters, bool clip, bool auto_frame, at::ScalarType st) {
  TORCH_CHECK(group > 0 && p.T % group == 0, "kvarn_quantize: expected whole tiles of ", group, " tokens");
  Job j;
  j.rot = p.rot.defined() ? p.rot.data_ptr<float>() : nullptr;
  j.plain = p.plain.data_ptr<float>();
  j.L = (int)p.L; j.n = (int)(p.T / group); j.G = (int)group; j.D = (int)p.D;
  j.is_k = is_k; j.bits = (int)bits; j.normalize = normalize; j.iters = (int)iters;
  j.clip = clip; j.auto_frame = auto_frame && j.rot != nullptr && is_k; j.st = st;
  TORCH_CHECK((j.C() * j.bits) % 8 == 0, "kvarn_quantize: a row of ", j.C(), " codes does not pack");
  return j;
}

std::vector<at::Tensor> alloc_out(Job& j) {
  const int64_t R = j.R(), C = j.C();
  auto opt = at::TensorOptions().device(at::kCPU);
  auto codes = at::empty({j.L, j.n, R, C * j.bits / 8}, opt.dtype(at::kByte));
  auto rs = at::empty({j.L, j.n, R}, opt.dtype(j.st));
  auto rz = at::empty({j.L, j.n, R}, opt.dtype(j.st));
  auto cs = at::empty({j.L, j.n, C}, opt.dtype(j.st));
  auto plain = at::zeros({j.L, j.n}, opt.dtype(at::kByte));
  j.codes = codes.data_ptr<uint8_t>(); j.rs = rs.data_ptr(); j.rz = rz.data_ptr();
  j.cs = cs.data_ptr(); j.plain_out = plain.data_ptr<uint8_t>();
  return {codes, rs, rz, cs, plain};
}

}  // namespace

// Quantize token-major x [..., T, D] into tiles: {codes [L, n, R, C*bits/8], row_scale,
// row_zero [L, n, R], col_scale [L, n, C], plain [L, n] uint8, flags} (L = prod(...)).
std::vector<torch::Tensor> kvarn_quantize(
    torch::Tensor x, std::optional<torch::Tensor> rot, bool is_k, int64_t bits, int64_t group,
    bool normalize, int64_t iters, bool clip, bool auto_frame, int64_t scale_code,
    std::vector<double> consts, std::vector<double> ratios) {
  const Consts k = make_consts(consts, ratios);
  Prepared p = prepare(x, rot);
  std::vector<Job> jobs{make_job(p, is_k, bits, group, normalize, iters, clip, auto_frame,
                                 scale_type(scale_code))};
  auto out = alloc_out(jobs[0]);
  const int flags = run_jobs(jobs, k);
  out.push_back(torch::tensor((int64_t)flags));
  return out;
}

// Freeze K [H, n*G, D] and V [H, n*G, Dv] of one batch row into tile slots first_tile.. of
// contiguous destinations [H, N, ...] (k_dst / v_dst = codes, row_scale, row_zero, col_scale;
// plain_dst [H, N] uint8 for key frames). rot / v_rot: the keys' [D, D] and the values'
// [Dv, Dv] rotations (both given, or neither: no rotation); Dv may differ from D (MLA).
// Returns false, writing nothing, when an input value is not finite or a scale overflows
// its dtype.
bool kvarn_freeze(torch::Tensor k, torch::Tensor v, std::optional<torch::Tensor> rot,
                  std::optional<torch::Tensor> v_rot, std::vector<torch::Tensor> k_dst,
                  std::vector<torch::Tensor> v_dst,
                  std::optional<torch::Tensor> plain_dst, int64_t first_tile, int64_t kb,
                  int64_t vb, int64_t group, bool normalize, int64_t iters, bool clip,
                  std::vector<double> consts, std::vector<double> ratios) {
  const Consts kc = make_consts(consts, ratios);
  TORCH_CHECK(k_dst.size() == 4 && v_dst.size() == 4, "kvarn_freeze: expected 4 destinations per kind");
  const at::ScalarType st = k_dst[1].scalar_type();
  TORCH_CHECK(rot.has_value() == v_rot.has_value(), "kvarn_freeze: expected both rotations or neither");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(0) == v.size(0) && k.size(1) == v.size(1),
              "kvarn_freeze: expected K [H, T, D] and V [H, T, Dv] of one row");
  for (const auto* r : {&rot, &v_rot})
    if (r->has_value()) {
      const int64_t d = (r == &rot ? k : v).size(-1);
      TORCH_CHECK((*r)->dim() == 2 && (*r)->size(0) == d && (*r)->size(1) == d,
                  "kvarn_freeze: expected a [", d, ", ", d, "] rotation");
    }
  Prepared pk = prepare(k, rot), pv = prepare(v, v_rot);
  std::vector<Job> jobs{make_job(pk, true, kb, group, normalize, iters, clip, plain_dst.has_value(), st),
                        make_job(pv, false, vb, group, normalize, iters, false, false, st)};
  auto ok = alloc_out(jobs[0]);
  auto ov = alloc_out(jobs[1]);
  if (run_jobs(jobs, kc)) return false;
  const int64_t n = jobs[0].n;
  auto put = [&](const at::Tensor& src, const at::Tensor& dst) {
    TORCH_CHECK(dst.is_contiguous() && dst.scalar_type() == src.scalar_type() && dst.dim() >= 2
                && dst.size(0) == src.size(0) && first_tile + n <= dst.size(1),
                "kvarn_freeze: a destination does not match");
    const int64_t heads = src.size(0), per = src[0].numel() / std::max<int64_t>(n, 1);
    const int64_t es = src.element_size();
    TORCH_CHECK(dst.numel() / (heads * dst.size(1)) == per, "kvarn_freeze: destination tile size");
    const char* s = (const char*)src.data_ptr();
    char* d = (char*)dst.data_ptr();
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(d + ((h * dst.size(1) + first_tile) * per) * es, s + h * n * per * es, n * per * es);
  };
  for (int i = 0; i < 4; ++i) { put(ok[i], k_dst[i]); put(ov[i], v_dst[i]); }
  if (plain_dst.has_value()) put(ok[4], *plain_dst);
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kvarn_quantize", torch::wrap_pybind_function(kvarn_quantize), "kvarn_quantize");
  m.def("kvarn_freeze", torch::wrap_pybind_function(kvarn_freeze), "kvarn_freeze");
}
