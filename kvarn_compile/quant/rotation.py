"""Orthonormal rotations of the head dimension.

KVarN right-multiplies every key, value and query row by an orthonormal matrix H
(H @ H.T = I) so that q·k is unchanged while outlier channels are spread out.

Which matrix, by head dim D:

* D = 2^k (64, 128, 256, ...): the normalized Sylvester Hadamard matrix,
  H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2). It is symmetric (H = H.T).
* D = 2^k * m with m in {12, 20, 28} (48, 80, 96, 112, 160, 192, 224, ...): the Kronecker
  product of the Sylvester matrix of order 2^k with a Paley Hadamard matrix of order m
  (Paley I for m = 12 and 20, from the primes 11 and 19; Paley II for m = 28, from the
  prime 13), normalized by 1/sqrt(D). Still a true Hadamard matrix: every entry is
  ±1/sqrt(D), so one outlier channel is spread evenly over all D channels. Not symmetric
  in general, so callers must use H.T to rotate back.
* any other even D: a fixed orthogonal matrix from the QR decomposition of a Gaussian
  matrix seeded with D (deterministic across runs and machines since it is built in
  float64 on the CPU). Orthonormal, but not a Hadamard matrix.

All matrices are built once per (D, device, dtype) in float64 and cached.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["rotation_matrix", "is_hadamard_dim", "rotate", "unrotate"]


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _quadratic_character(q: int) -> list[int]:
    """chi(x) for x in Z_q, q prime: 0 at 0, +1 on quadratic residues, -1 otherwise."""
    residues = {(x * x) % q for x in range(1, q)}
    return [0] + [1 if x in residues else -1 for x in range(1, q)]


def _jacobsthal(q: int) -> torch.Tensor:
    chi = _quadratic_character(q)
    return torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)],
                        dtype=torch.float64)


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1 Hadamard matrix for a prime q = 3 (mod 4)."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return s + torch.eye(n, dtype=torch.float64)


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1) Hadamard matrix for a prime q = 1 (mod 4)."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    plus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    minus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    out = torch.zeros(2 * n, 2 * n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            block = minus if i == j else (plus if c[i, j] > 0 else -plus)
            out[2 * i:2 * i + 2, 2 * j:2 * j + 2] = block
    return out


_PALEY = {12: lambda: _paley1(11), 20: lambda: _paley1(19), 28: lambda: _paley2(13)}


def _split_dim(d: int) -> tuple[int, int] | None:
    """(2^k, m) with d = 2^k * m and m in {1, 12, 20, 28}, or None."""
    for m in (1, 12, 20, 28):
        if d % m == 0:
            p = d // m
            if p & (p - 1) == 0:
                return p, m
    return None


def is_hadamard_dim(d: int) -> bool:
    """True when the rotation for head dim ``d`` is a true (±1/sqrt(d)) Hadamard matrix."""
    return _split_dim(d) is not None


@functools.lru_cache(maxsize=None)
def _rotation_f64(d: int) -> torch.Tensor:
    split = _split_dim(d)
    if split is not None:
        p, m = split
        h = _sylvester(p)
        if m > 1:
            h = torch.kron(h, _PALEY[m]())
        return h / d ** 0.5
    gen = torch.Generator().manual_seed(0x4B56 + d)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


@functools.lru_cache(maxsize=64)
def rotation_matrix(d: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal [d, d] rotation for head dim ``d`` (see the module docstring)."""
    if not isinstance(d, int) or d < 2 or d % 2:
        raise ValueError(f"Expected an even head_dim >= 2 for the KVarN rotation, but got {d!r}.")
    return _rotation_f64(d).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H over the last dim, computed in float32 (an fp16 rotation can overflow)."""
    h = rotation_matrix(x.shape[-1], x.device)
    return x.float() @ h


def unrotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H.T over the last dim, in float32: the inverse of :func:`rotate`."""
    h = rotation_matrix(x.shape[-1], x.device)
    return x.float() @ h.T
