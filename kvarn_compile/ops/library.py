"""``torch.ops.kvarn.*``: custom ops over the packed layer state, with fake kernels.

Each op's default implementation is its pure-torch reference (:mod:`.reference`); CUDA
tensors use the Triton kernels of :mod:`kvarn_compile.kernels` where they apply. The
fake kernels compute shapes and check devices (they also serve the Meta dispatch key), so
the ops trace under torch.compile and FakeTensor.

    kvarn::append_(Tensor(a!)[] buffers, Tensor k, Tensor v, Tensor start_pos, str method,
                   int iters, int recent, int hold, bool check_finite, str name) -> ()
    kvarn::commit_(Tensor(a!)[] buffers, Tensor upto, str method, int iters, int recent,
                   bool check_finite, str name) -> ()
    kvarn::attention(Tensor q, Tensor[] buffers, Tensor? mask, float scale, bool causal,
                     int window) -> Tensor
"""

from __future__ import annotations

import os

import torch

from kvarn_compile.ops import reference

__all__ = ["append_", "commit_", "attention"]


@torch.library.custom_op("kvarn::append_", mutates_args=("buffers",))
def append_(buffers: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
            start_pos: torch.Tensor, method: str, iters: int, recent: int,
            hold: int, check_finite: bool, name: str) -> None:
    """Quantize-on-append: write K/V [B, H, T, D] at start_pos [B] (see ops.reference)."""
    reference.append_(buffers, k, v, start_pos, method=method, iters=iters, recent=recent,
                      hold=hold, check_finite=check_finite, name=name)


def _check_devices(op: str, buffers: list[torch.Tensor], **tensors: torch.Tensor | None) -> None:
    """The data-free part of the eager checks, for the fake kernels.

    A fake kernel also serves the Meta dispatch key, so without this an op called with a
    meta tensor next to a real cache would silently do nothing instead of failing like the
    eager kernel does.
    """
    device = buffers[0].device
    for label, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"KVarN {op}: expected {label} on {device} like the cache, but got "
                             f"{t.device}. Move the cache or the model.")


@append_.register_fake
def _append_fake(buffers, k, v, start_pos, method, iters, recent, hold, check_finite, name):
    _check_devices("append", buffers, keys=k, values=v)
    return None


@torch.library.custom_op("kvarn::commit_", mutates_args=("buffers",))
def commit_(buffers: list[torch.Tensor], upto: torch.Tensor, method: str, iters: int,
            recent: int, check_finite: bool, name: str) -> None:
    """Commit tokens < upto[b] and freeze every tile that became complete."""
    reference.commit_(buffers, upto, method=method, iters=iters, recent=recent,
                      check_finite=check_finite, name=name)


@commit_.register_fake
def _commit_fake(buffers, upto, method, iters, recent, check_finite, name):
    return None


@torch.library.custom_op("kvarn::attention", mutates_args=())
def attention(q: torch.Tensor, buffers: list[torch.Tensor], mask: torch.Tensor | None,
              scale: float, causal: bool, window: int) -> torch.Tensor:
    """Fused dual-scale dequant attention of q [B, Hq, Tq, D] over the packed cache."""
    return reference.attention(q, buffers, mask, scale, causal, window).contiguous()


@attention.register_fake
def _attention_fake(q, buffers, mask, scale, causal, window):
    _check_devices("attention", buffers, queries=q)
    return q.new_empty(q.shape)      # contiguous, whatever q's strides (as the kernels return)


@attention.register_kernel("cuda")
def _attention_cuda(q, buffers, mask, scale, causal, window):
    from kvarn_compile.kernels import triton_available
    from kvarn_compile.ops import kernel_impl

    if not triton_available():
        return reference.attention(q, buffers, mask, scale, causal, window).contiguous()
    return kernel_impl.attention(q, buffers, mask, scale, causal, window).contiguous()


@attention.register_kernel("cpu")
def _attention_cpu(q, buffers, mask, scale, causal, window):
    # The C++ tile kernel where it applies and builds (KVARN_CPU_KERNEL=0 turns it off);
    # otherwise the pure-torch reference.
    from kvarn_compile.kernels import cpu_attention
    from kvarn_compile.ops import kernel_impl

    if os.environ.get("KVARN_CPU_KERNEL", "1") != "0" and q.shape[2] <= 16 \
            and kernel_impl.kernel_applies(q, buffers, mask) and cpu_attention.available():
        return kernel_impl.attention(q, buffers, mask, scale, causal, window, kernel="cpu").contiguous()
    return reference.attention(q, buffers, mask, scale, causal, window).contiguous()
