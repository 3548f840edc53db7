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

namespace kvarn {

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
