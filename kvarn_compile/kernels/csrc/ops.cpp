// Native dispatcher kernels of the per-token cache ops on CPU: kvarn::append_ and
// kvarn::append_from_ at the AutogradCPU key (registered once by register_native_ops,
// called from kernels/cpu/attention.py when this extension loads).
//
// A compiled decode step calls one of these ops per layer and token. Through custom_op's
// Python kernels that is ~14 us of dispatch and Python around a ~1.5 us C++ append; here the
// decode-step append (append.cpp) runs straight from the dispatcher where it applies, with
// exactly the outcome of the Python CPU kernel (ops/dispatch.py):
//   * KVARN_CPU_KERNEL is not "0", check_finite is off, the method is one the runtime reads
//     (the list ops/append.py hands over: anything else raises in Python);
//   * append_from_: both model cache tensors are released and untouched since (the storage
//     and version the Python release recorded here, note_released), so the adoption step has
//     nothing to take over;
//   * no Python dispatch mode, functionalization or pre-dispatch tracing is on, every tensor
//     it reads or writes is a plain dense CPU tensor (not fake, functional, batched, ...),
//     and kvarn_append_decode applies (every row continues its sequence, no tile
//     completes, ...).
// Anything else redispatches below autograd, to the Python kernels, as custom_op's own
// autograd kernel does (nothing there records autograd history on the packed buffers).
#include "kvarn_common.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace {

struct Released {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t version;
};

std::mutex registry_mutex;
// storage -> (weak reference, version counter at its release); leaked: read at exit too
auto& released = *new std::unordered_map<const c10::StorageImpl*, Released>();
auto& methods = *new std::unordered_set<std::string>();

bool kernel_off() {
  const char* e = std::getenv("KVARN_CPU_KERNEL");
  if (e == nullptr) return false;
  std::string s(e);
  const auto a = s.find_first_not_of(" \t\n"), b = s.find_last_not_of(" \t\n");
  return a != std::string::npos && s.substr(a, b - a + 1) == "0";
}

// ops.buffers.untouched_since_release, from what note_released recorded (a zero-byte
// storage counts as released, as there)
bool untouched_since_release(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  const c10::Storage& st = t.storage();
  if (st.nbytes() == 0) return true;
  const c10::StorageImpl* impl = st.unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = released.find(impl);
  if (it == released.end()) return false;
  auto alive = it->second.storage.lock();
  // an inference tensor (an alias made under torch.inference_mode) counts no versions: it
  // may have been written, the data decides (as in Python)
  return alive.get() == impl && !t.is_inference() && it->second.version == t._version();
}

// The dispatch keys of a plain dense CPU tensor (set at registration): a fake, functional,
// batched, sparse, conjugate or negative-bit tensor has others, and goes to Python.
c10::DispatchKeySet plain_keys;

bool plain_cpu(const at::Tensor& t) {
  return t.defined() && t.unsafeGetTensorImpl()->key_set() == plain_keys && t.device().is_cpu();
}

// A Python dispatch mode (FakeTensorMode, a logging mode, ...), functionalization or
// pre-dispatch tracing is on: it must see the op, so it goes the usual way.
bool traced(c10::DispatchKeySet ks) {
  for (auto k : {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::Functionalize,
                 c10::DispatchKey::PreDispatch, c10::DispatchKey::PythonDispatcher})
    if (ks.has(k)) return true;
  return false;
}

// The fast path; false: nothing written, the Python kernel runs.
bool append_native(c10::DispatchKeySet ks, torch::jit::Stack* stack, size_t n_args, bool from) {
  if (traced(ks)) return false;
  auto args = torch::jit::last(*stack, n_args);
  // append_(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name
  //         [, cache_k, cache_v, fresh])
  if (kernel_off() || args[8].toBool() || !methods.count(std::string(args[4].toStringRef()))) return false;
  if (from) {
    const at::Tensor ck = args[10].toTensor(), cv = args[11].toTensor();
    if (!plain_cpu(ck) || !plain_cpu(cv) || !untouched_since_release(ck) || !untouched_since_release(cv))
      return false;
  }
  using namespace kvarn;
  const c10::List<at::Tensor> list = args[0].toTensorList();
  const size_t n = list.size();
  if (n != N_BASE && n != N_BASE + 1 && n != N_BASE + 4 && n != N_BASE + 5) return false;
  std::vector<at::Tensor> b;
  b.reserve(N_BASE);
  for (size_t i = 0; i < N_BASE; ++i) b.push_back(list.get(i));
  for (int i : {SINK_K, SINK_V, K_COL_SCALE, TAIL_K, TAIL_V, LENGTHS, COMMITTED, N_TILES, CAPACITY})
    if (!plain_cpu(b[i])) return false;
  const at::Tensor k = args[1].toTensor(), v = args[2].toTensor(), start = args[3].toTensor();
  if (!plain_cpu(k) || !plain_cpu(v) || !plain_cpu(start) || b[K_COL_SCALE].dim() != 4) return false;
  return kvarn_append_decode(k, v, b[SINK_K], b[SINK_V], b[TAIL_K], b[TAIL_V], b[LENGTHS], b[COMMITTED],
                             b[N_TILES], b[CAPACITY], start, b[K_COL_SCALE].size(3),  // G
                             args[6].toInt(), args[7].toInt());
}

template <size_t N, bool FROM>
void append_autograd_cpu(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (append_native(ks, stack, N, FROM)) {
    torch::jit::drop(*stack, N);
    return;
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

}  // namespace

void kvarn_note_released(torch::Tensor t) {
  if (!t.defined() || !t.has_storage() || t.is_inference()) return;
  const c10::Storage& st = t.storage();
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (released.size() > 4096)        // storages gone since: drop them
    for (auto it = released.begin(); it != released.end();)
      it = it->second.storage.expired() ? released.erase(it) : std::next(it);
  released.insert_or_assign(st.unsafeGetStorageImpl(), Released{st.getWeakStorageImpl(), t._version()});
}

void kvarn_register_native_ops(std::vector<std::string> valid_methods) {
  static bool done = false;
  if (done) return;
  done = true;
  methods.insert(valid_methods.begin(), valid_methods.end());
  {
    c10::InferenceMode normal(false);     // a normal tensor's keys, also if called in inference mode
    plain_keys = at::empty({1}).unsafeGetTensorImpl()->key_set();
  }
  auto* lib = new torch::Library(torch::Library::IMPL, "kvarn", c10::DispatchKey::AutogradCPU,
                                 __FILE__, __LINE__);   // leaked: the kernels stay registered
  lib->impl("append_", torch::CppFunction::makeFromBoxedFunction<&append_autograd_cpu<10, false>>());
  lib->impl("append_from_", torch::CppFunction::makeFromBoxedFunction<&append_autograd_cpu<13, true>>());
}
