// Shared by the C++ CPU kernels of kvarn_compile (built by kernels/cpu/build.py): the
// includes, the one function called across files, and the storage-dtype dispatch.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// ---------------------------------------------------------------- across files
// The decode-step append (append.cpp), bound with kvarn_attention in attention.cpp.
bool kvarn_append_decode(torch::Tensor k, torch::Tensor v, torch::Tensor sink_k, torch::Tensor sink_v,
                         torch::Tensor tail_k, torch::Tensor tail_v, torch::Tensor lengths,
                         torch::Tensor committed, torch::Tensor n_tiles, torch::Tensor capacity,
                         torch::Tensor start_pos, int64_t group, int64_t recent, int64_t hold);

// The native dispatcher kernels of the per-token cache ops (ops.cpp), bound in attention.cpp.
void kvarn_register_native_ops(std::vector<std::string> valid_methods);
void kvarn_note_released(torch::Tensor t);

// kvarn::latent_attention over a latent state's flat buffer list (latent_attention.cpp),
// bound in attention.cpp.
torch::Tensor kvarn_latent_attention_state(torch::Tensor q, torch::Tensor q_pe, std::vector<torch::Tensor> b,
                                           std::optional<torch::Tensor> mask, torch::Tensor rot,
                                           torch::Tensor rot_t, torch::Tensor rot_pe, double scale,
                                           bool causal, int64_t window, int64_t task_rows);

namespace kvarn {

// ---------------------------------------------------------------- state layout
// Positions of a state's base members in its flat buffer list: state.py's BASE_FIELDS order
// (MEMBER_NAMES is handed to Python, kvarn_state_members, and tested against it); a state
// holds N_BASE of them, then 4 fp8 factors and / or k_plain (16, 17, 20 or 21 buffers).
enum Member : int {
  SINK_K, SINK_V, K_CODES, K_ROW_SCALE, K_ROW_ZERO, K_COL_SCALE, V_CODES, V_ROW_SCALE,
  V_ROW_ZERO, V_COL_SCALE, TAIL_K, TAIL_V, LENGTHS, COMMITTED, N_TILES, CAPACITY, N_BASE
};
inline const char* const MEMBER_NAMES[N_BASE] = {
  "sink_k", "sink_v", "k_codes", "k_row_scale", "k_row_zero", "k_col_scale", "v_codes",
  "v_row_scale", "v_row_zero", "v_col_scale", "tail_k", "tail_v", "lengths", "committed",
  "n_tiles", "capacity"};

// ---------------------------------------------------------------- storage dtypes
// f(E{}) with E the element type a buffer of dtype `st` is written as: c10::Half for fp16,
// c10::BFloat16 for bf16, float for anything else (the sink/tail rows, the tile scales).
template <typename F>
inline void with_storage_type(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: f(float{}); break;
  }
}

}  // namespace kvarn
