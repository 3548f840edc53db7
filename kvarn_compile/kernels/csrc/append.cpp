// Decode-step append fast path: the reference append (ops/append.py) of the common case
// in one call. Every row continues its sequence (start == lengths == committed > 0), all new
// tokens are committed (hold == 0) and no tile completes, so the write is: round the new
// rows to the exact dtype, store them in the sink or the tail ring, bump the counters.
// Anything else (a new sequence, a rollback, speculative tokens, a freeze, a full tail,
// the capacity, an fp16 overflow) returns false with nothing written: the caller runs the
// reference, which also raises the descriptive errors.
// Built by kernels/cpu/build.py into the attention extension (bound in attention.cpp);
// launcher: append_decode in kernels/cpu/attention.py.
#include "kvarn_common.h"

template <typename E>
static void put_rows(const torch::Tensor& x, E* dst, int64_t b, int64_t H, int64_t T, int64_t D,
                     int64_t slots, const std::vector<int64_t>& slot_of, int64_t row_stride_b) {
  auto xf = x.accessor<float, 4>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t) {
      if (slot_of[t] < 0) continue;
      E* out = dst + ((b * H + h) * slots + slot_of[t]) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<E>(xf[b][h][t][d]);
    }
  (void)row_stride_b;
}

bool kvarn_append_decode(torch::Tensor k, torch::Tensor v, torch::Tensor sink_k, torch::Tensor sink_v,
                         torch::Tensor tail_k, torch::Tensor tail_v, torch::Tensor lengths,
                         torch::Tensor committed, torch::Tensor n_tiles, torch::Tensor capacity,
                         torch::Tensor start_pos, int64_t group, int64_t recent, int64_t hold) {
  if (hold != 0 || k.dim() != 4 || v.dim() != 4 || !k.is_floating_point()
      || !v.is_floating_point() || k.device().type() != c10::DeviceType::CPU) return false;
  // D: the keys' head dim, DV: the values' (they differ for MLA decompressed, e.g. 192 / 128)
  const int64_t B = sink_k.size(0), H = sink_k.size(1), S = sink_k.size(2), D = sink_k.size(3);
  const int64_t DV = sink_v.size(3), W = tail_k.size(2), T = k.size(2);
  if (k.size(0) != B || k.size(1) != H || k.size(3) != D || T < 1) return false;
  if (v.size(0) != B || v.size(1) != H || v.size(2) != T || v.size(3) != DV) return false;
  if (sink_v.size(2) != S || tail_v.size(2) != W || tail_k.size(3) != D || tail_v.size(3) != DV) return false;
  if (start_pos.dim() != 1 || start_pos.size(0) != B) return false;
  if (start_pos.scalar_type() != torch::kLong && start_pos.scalar_type() != torch::kInt) return false;
  for (const auto& t : {sink_k, sink_v, tail_k, tail_v})
    if (!t.is_contiguous() || t.scalar_type() != tail_k.scalar_type()) return false;
  for (const auto& t : {lengths, committed, n_tiles, capacity})
    if (!t.is_contiguous() || t.scalar_type() != torch::kLong) return false;
  auto start = start_pos.to(torch::kLong);
  const int64_t* sp = start.data_ptr<int64_t>();
  int64_t* len = lengths.data_ptr<int64_t>();
  int64_t* com = committed.data_ptr<int64_t>();
  const int64_t* nt = n_tiles.data_ptr<int64_t>();
  const int64_t cap = capacity.data_ptr<int64_t>()[0];
  const int64_t n_max = 0;  (void)n_max;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p0 = sp[b], end = p0 + T;
    if (p0 <= 0 || p0 != len[b] || com[b] != len[b] || end > cap) return false;
    const int64_t frozen_end = S + nt[b] * group;
    if (end > S && (end - frozen_end - recent) >= group) return false;   // a tile completes
    if (end - std::max(frozen_end, S) > W) return false;                  // tail full
  }
  auto kf = k.to(torch::kFloat).contiguous(), vf = v.to(torch::kFloat).contiguous();
  const auto exact = tail_k.scalar_type();
  if (exact == torch::kHalf && k.scalar_type() != torch::kHalf) {        // fp16 range (reference raises)
    // a plain loop over the step's few rows: the tensor ops it replaces were ~8 dispatches
    for (const auto& x : {kf, vf}) {
      const float* p = x.data_ptr<float>();
      float peak = 0.f;
      for (int64_t i = 0, n = x.numel(); i < n; ++i) {
        const float a = std::fabs(p[i]);
        if (a <= std::numeric_limits<float>::max()) peak = std::max(peak, a);  // NaN, inf: not range
      }
      if (peak > 65504.0f) return false;
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p0 = sp[b];
    std::vector<int64_t> sink_slot(T, -1), tail_slot(T, -1);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = p0 + t;
      if (p < S) sink_slot[t] = p; else tail_slot[t] = ((p - S) % W + W) % W;
    }
    kvarn::with_storage_type(exact, [&](auto tag) {
      using E = decltype(tag);
      put_rows<E>(kf, sink_k.data_ptr<E>(), b, H, T, D, S, sink_slot, 0);
      put_rows<E>(vf, sink_v.data_ptr<E>(), b, H, T, DV, S, sink_slot, 0);
      put_rows<E>(kf, tail_k.data_ptr<E>(), b, H, T, D, W, tail_slot, 0);
      put_rows<E>(vf, tail_v.data_ptr<E>(), b, H, T, DV, W, tail_slot, 0);
    });
    len[b] = p0 + T;
    com[b] = p0 + T;
  }
  return true;
}
