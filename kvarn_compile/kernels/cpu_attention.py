"""CPU kernel: attention of rotated queries over the packed KVarN tiles, in C++.

The same math as the Triton decode kernel (``kernels/attention.py``) and the reference
(``ops/reference.py``): per tile, the key row scale is folded into q, the key column scale
into the scores, the value row scale into the softmax weights and the value column scale
into the output; codes are unpacked in registers, never into a dequantized K/V. Online
softmax over the tiles, split over tile ranges for parallelism (OpenMP), merged by
log-sum-exp. Returns the output over the quantized region (rotated frame) and its lse, so
the caller merges it with the exact sink/tail exactly like the CUDA path does.

The extension is compiled on first use with ``torch.utils.cpp_extension.load_inline``
(needs a C++ compiler and ninja; about a minute, then cached). If it cannot be built,
:func:`available` is False and the ops use the pure-torch reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform

import torch

__all__ = ["available", "tile_attention"]

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// Unpack a packed [rows, cols*BITS/8] code block into floats [rows, cols] (once per tile).
template <int BITS>
static inline void unpack(const uint8_t* codes, int rows, int cols, float* out) {
  constexpr int PER = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int64_t n = (int64_t)rows * cols / PER;
  for (int k = 0; k < PER; ++k)
    for (int64_t i = 0; i < n; ++i) out[i * PER + k] = (float)((codes[i] >> (k * BITS)) & MASK);
}

template <int KB, int VB>
static void run(const float* q, const uint8_t* kc, const float* krs, const float* krz, const float* kcs,
                const uint8_t* vc, const float* vrs, const float* vrz, const float* vcs,
                const int64_t* n_tiles, const int64_t* kv_start, bool has_start,
                int B, int H, int HQ, int TQ, int D, int N, int G, int splits, float scale,
                float* o_part, float* m_part, float* l_part) {
  const int grp = HQ / H, R = grp * TQ;
  at::parallel_for(0, (int64_t)B * H * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(D), s(G), w(G), tmp(D), acc((size_t)R * D), m(R), l(R);
    std::vector<float> kf((size_t)D * G), vf((size_t)G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int sp = task % splits, bh = task / splits, b = bh / H, h = bh % H;
      const int tiles = (int)std::min<int64_t>(std::max<int64_t>(n_tiles[b], 0), N);
      const int per = (tiles + splits - 1) / splits;
      const int j0 = sp * per, j1 = std::min(tiles, j0 + per);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int j = j0; j < j1; ++j) {
        const int64_t tile = ((int64_t)bh * N + j);
        unpack<KB>(kc + tile * D * (G * KB / 8), D, G, kf.data());
        unpack<VB>(vc + tile * G * (D * VB / 8), G, D, vf.data());
        const float *ks = krs + tile * D, *kz = krz + tile * D, *kcol = kcs + tile * G;
        const float *vs = vrs + tile * G, *vz = vrz + tile * G, *vcol = vcs + tile * D;
        for (int r = 0; r < R; ++r) {
          const int gi = r / TQ, tq = r % TQ;
          const float* qr = q + (((int64_t)b * HQ + h * grp + gi) * TQ + tq) * D;
          float bias = 0.f;
          for (int c = 0; c < D; ++c) { qs[c] = qr[c] * ks[c]; bias += qr[c] * kz[c]; }
          // s[t] = sum_c qs[c] * code[c, t]  (axpy over contiguous token rows)
          for (int t = 0; t < G; ++t) s[t] = 0.f;
          for (int c = 0; c < D; ++c) {
            const float wc = qs[c];
            const float* row = kf.data() + (int64_t)c * G;
            for (int t = 0; t < G; ++t) s[t] += wc * row[t];
          }
          const int64_t lo = has_start ? kv_start[(int64_t)b * TQ + tq] : 0;
          float mx = -std::numeric_limits<float>::infinity();
          for (int t = 0; t < G; ++t) {
            float v = (s[t] + bias) * kcol[t] * scale;
            if ((int64_t)j * G + t < lo) v = -std::numeric_limits<float>::infinity();
            s[t] = v;
            mx = std::max(mx, v);
          }
          if (mx == -std::numeric_limits<float>::infinity()) continue;
          const float m_new = std::max(m[r], mx);
          const float alpha = std::exp(m[r] - m_new);
          float psum = 0.f, zsum = 0.f;
          for (int t = 0; t < G; ++t) {
            const float p = std::exp(s[t] - m_new);
            psum += p; zsum += p * vz[t]; w[t] = p * vs[t];
          }
          // tmp[c] = sum_t w[t] * code[t, c]  (axpy over contiguous channel rows)
          std::fill(tmp.begin(), tmp.end(), 0.f);
          for (int t = 0; t < G; ++t) {
            const float wt = w[t];
            const float* row = vf.data() + (int64_t)t * D;
            for (int c = 0; c < D; ++c) tmp[c] += wt * row[c];
          }
          float* ar = acc.data() + (int64_t)r * D;
          for (int c = 0; c < D; ++c) ar[c] = ar[c] * alpha + vcol[c] * (tmp[c] + zsum);
          l[r] = l[r] * alpha + psum;
          m[r] = m_new;
        }
      }
      for (int r = 0; r < R; ++r) {
        const int gi = r / TQ, tq = r % TQ;
        const int64_t row = (((int64_t)b * HQ + h * grp + gi) * TQ + tq) * splits + sp;
        for (int c = 0; c < D; ++c) o_part[row * D + c] = acc[(int64_t)r * D + c];
        m_part[row] = m[r];
        l_part[row] = l[r];
      }
    }
  });
}

std::vector<torch::Tensor> kvarn_tile_attention(
    torch::Tensor q, torch::Tensor kc, torch::Tensor krs, torch::Tensor krz, torch::Tensor kcs,
    torch::Tensor vc, torch::Tensor vrs, torch::Tensor vrz, torch::Tensor vcs,
    torch::Tensor n_tiles, torch::Tensor kv_start, double scale, int64_t kb, int64_t vb, int64_t splits) {
  const int B = q.size(0), HQ = q.size(1), TQ = q.size(2), D = q.size(3);
  const int H = kc.size(1), N = kc.size(2), G = kcs.size(3);
  auto opts = q.options();
  auto o_part = torch::zeros({B, HQ, TQ, splits, D}, opts);
  auto m_part = torch::full({B, HQ, TQ, splits}, -std::numeric_limits<float>::infinity(), opts);
  auto l_part = torch::zeros({B, HQ, TQ, splits}, opts);
  const bool has_start = kv_start.numel() > 0;
  #define KVARN_RUN(KB_, VB_) run<KB_, VB_>(q.data_ptr<float>(), kc.data_ptr<uint8_t>(), \
      krs.data_ptr<float>(), krz.data_ptr<float>(), kcs.data_ptr<float>(), vc.data_ptr<uint8_t>(), \
      vrs.data_ptr<float>(), vrz.data_ptr<float>(), vcs.data_ptr<float>(), n_tiles.data_ptr<int64_t>(), \
      has_start ? kv_start.data_ptr<int64_t>() : nullptr, has_start, B, H, HQ, TQ, D, N, G, (int)splits, \
      (float)scale, o_part.data_ptr<float>(), m_part.data_ptr<float>(), l_part.data_ptr<float>())
  if (kb == 4 && vb == 2) KVARN_RUN(4, 2);
  else if (kb == 4 && vb == 4) KVARN_RUN(4, 4);
  else if (kb == 2 && vb == 2) KVARN_RUN(2, 2);
  else if (kb == 8 && vb == 8) KVARN_RUN(8, 8);
  else if (kb == 2 && vb == 4) KVARN_RUN(2, 4);
  else if (kb == 8 && vb == 4) KVARN_RUN(8, 4);
  else if (kb == 4 && vb == 8) KVARN_RUN(4, 8);
  else TORCH_CHECK(false, "kvarn CPU kernel: unsupported bit widths k", kb, " v", vb);
  #undef KVARN_RUN
  return {o_part, m_part, l_part};
}
"""

_CPP_DECL = ("std::vector<torch::Tensor> kvarn_tile_attention(torch::Tensor q, torch::Tensor kc, "
             "torch::Tensor krs, torch::Tensor krz, torch::Tensor kcs, torch::Tensor vc, "
             "torch::Tensor vrs, torch::Tensor vrz, torch::Tensor vcs, torch::Tensor n_tiles, "
             "torch::Tensor kv_start, double scale, int64_t kb, int64_t vb, int64_t splits);")
SUPPORTED_BITS = {(4, 2), (4, 4), (2, 2), (8, 8), (2, 4), (8, 4), (4, 8)}


@functools.lru_cache(maxsize=1)
def _module():
    from torch.utils.cpp_extension import load_inline

    # -march=native: the extension is built on (and cached for) the machine that runs it;
    # the CPU model is part of the name so a cache shared between machines never mixes them.
    cpu = hashlib.sha1(_cpu_model().encode()).hexdigest()[:8]
    return load_inline(name=f"kvarn_cpu_attention_v2_{cpu}", cpp_sources=[_CPP_DECL, _SOURCE],
                       functions=["kvarn_tile_attention"], extra_cflags=["-O3", "-march=native"],
                       verbose=False)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the C++ kernel builds (or is already built) on this machine."""
    try:
        _module()
        return True
    except Exception as err:  # no compiler, no ninja, headers missing ...
        log.warning("kvarn: the CPU attention kernel could not be built (%s); using the "
                    "pure-torch reference instead.", str(err).splitlines()[0] if str(err) else err)
        return False


def tile_attention(q_rot: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor],
                   n_tiles: torch.Tensor, *, scale: float, kv_start: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_rot fp32 [B, Hq, Tq, D], lse [B, Hq, Tq]) over the packed tiles.

    k = [codes, row_scale, row_zero, col_scale], v likewise (layouts of ``state.py``).
    Rows with no visible quantized token get out = 0 and lse = -inf.
    """
    g = k[3].shape[-1]
    d = q_rot.shape[-1]
    kb, vb = 8 * k[0].shape[-1] // g, 8 * v[0].shape[-1] // d
    if (kb, vb) not in SUPPORTED_BITS:
        raise NotImplementedError(f"kvarn CPU kernel: expected bit widths in {sorted(SUPPORTED_BITS)}, "
                                  f"but got k{kb} v{vb}.")
    used = int(n_tiles.max()) if n_tiles.numel() else 0
    splits = max(1, min(torch.get_num_threads() * 2, used // 4 or 1))
    f32 = [t.float().contiguous() for t in (k[1], k[2], k[3], v[1], v[2], v[3])]
    start = kv_start.to(torch.int64).contiguous() if kv_start is not None else \
        torch.empty(0, dtype=torch.int64)
    o_part, m_part, l_part = _module().kvarn_tile_attention(
        q_rot.float().contiguous(), k[0].contiguous(), f32[0], f32[1], f32[2], v[0].contiguous(),
        f32[3], f32[4], f32[5], n_tiles.to(torch.int64).contiguous(), start, float(scale), kb, vb, splits)
    m = m_part.amax(-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(m_part - m_safe) * 1.0                       # [B,Hq,Tq,S]
    l = (w * l_part).sum(-1)
    out = (w[..., None] * o_part).sum(-2) / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    lse = torch.where(l > 0, torch.log(l.clamp_min(torch.finfo(torch.float32).tiny)) + m_safe[..., 0],
                      torch.full_like(l, float("-inf")))
    out = torch.where((l > 0)[..., None], out, torch.zeros_like(out))
    return out, lse
