"""A fuzzer over *flows*: random sequences of generate / forward calls on one compiled model.

Each flow runs a few steps on a model compiled with ``kvarn_backend`` — ``generate`` with a
dynamic or a static cache, chunked forwards, single-token decoding, a second request, a
``copy.deepcopy`` of a filled cache continued twice, ``crop`` (into the packed tiles too),
assisted decoding (a draft model of other weights, or prompt lookup), continuing a cache an
earlier flow left alive (compiled, or by the model's uncompiled forward),
``output_hidden_states``, batch sizes 1 and 2, eager forwards in between —
and compares every step's logits with the uncompressed model fed the same tokens (teacher
forcing, so greedy streams that part on a near-tie do not matter). A step passes when its
logits are within the preset's quantization error of the uncompressed ones — ``margin``
times the error of the same model over the same tokens with the same preset applied to a
whole-sequence cache (the eager ``KVarNCache`` path), plus ``rtol`` of the largest logit
for float noise; for a crop into the tiles and assisted decoding, whose rollback revises a
frozen tile (its kept tokens are quantized twice), the error of the same flow on the eager
``KVarNCache`` where that is larger — or when it is refused with a
one-line error of the project (``KVarN ...`` / ``kvarn_backend: ...``) — then the flow
moves on with a new cache. Anything else (a silent mismatch, another exception) is a
finding: :func:`run_flows` returns them all, each with the flow's seed and steps, so a
finding replays alone.

Subjects: :class:`HFSubject` (a tiny transformers model: its own caches and ``generate``)
and :class:`HelperSubject` (a plain function, no ``nn.Module``: an attention helper shared by
two layers over caches the caller owns, reading a prefix of the cache, or a window of it
once the sequence is longer than the window, or with a graph break between the cache write
and the attention; now and then a step runs the helper uncompiled over those caches).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import traceback
import warnings
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Finding", "HFSubject", "HelperSubject", "run_flows", "REFUSALS"]

#: the prefixes of the project's one-line refusals (a step refused with one passes)
REFUSALS = ("KVarN", "kvarn_backend", "kvarn_compile")


@dataclasses.dataclass
class Finding:
    seed: int
    steps: list[str]
    what: str

    def __str__(self) -> str:
        return f"flow seed {self.seed}: {' -> '.join(self.steps)}: {self.what}"


class _Refused(Exception):
    pass


def _refusal(err: BaseException) -> bool:
    text = str(err).strip()
    while isinstance(err, Exception) and not text.startswith(REFUSALS) and err.__cause__ is not None:
        err = err.__cause__
        text = str(err).strip()
    return text.startswith(REFUSALS) and "\n" not in text.split("\n\n")[0]


#: how many times the preset's own quantization error a step may be off
MARGIN = 3.0


def _capacity(cache: Any) -> int:
    """Tokens a transformers cache can hold (-1: it grows): ``get_max_length`` (transformers
    >= 5.18) or ``get_max_cache_shape``."""
    for name in ("get_max_length", "get_max_cache_shape"):
        fn = getattr(cache, name, None)
        if fn is not None:
            n = fn()
            return -1 if n is None else int(n)
    return -1


def _compare(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor], rtol: float,
             what: str) -> None:
    """``got`` against ``want`` = (uncompressed logits, logits of the same tokens through a
    whole-sequence cache of the preset): within MARGIN x that quantization error + rtol."""
    fp, quantized = (w.float() for w in want)
    if got.shape != fp.shape:
        raise AssertionError(f"{what}: logits of shape {tuple(got.shape)}, expected {tuple(fp.shape)}")
    err = (got.float() - fp).abs().max().item()
    scale = fp.abs().max().item()
    bound = MARGIN * (quantized - fp).abs().max().item() + rtol * scale
    if not err <= bound:
        raise AssertionError(f"{what}: max logit error {err:.3g} > {bound:.3g} (the preset's own "
                             f"error x {MARGIN:g} + {rtol} x {scale:.3g})")


# ------------------------------------------------------------------------------ subjects
class HFSubject:
    """A tiny transformers model compiled with ``backend``, next to its uncompressed twin."""

    name = "hf"

    def __init__(self, backend: Any, family: str = "llama", max_len: int = 256) -> None:
        from kvarn_compile.hf import use_kvarn_attention
        from kvarn_compile.testing.models import tiny_model

        self.fp = tiny_model(family)
        self.model = copy.deepcopy(self.fp)
        self.model.compile(backend=backend)
        self.q = copy.deepcopy(self.fp)
        use_kvarn_attention(self.q)
        #: a draft model that disagrees with the model (other weights): drafts get rejected
        self.assistant = tiny_model(family, seed=1)
        self.backend = backend
        self.max_len = max_len
        self.vocab = self.fp.config.vocab_size
        #: live caches of earlier steps: (cache, token ids it holds [B, L])
        self.alive: list[tuple[Any, torch.Tensor]] = []

    # the uncompressed model's logits for ids[:, start:] given ids[:, :start], and those of
    # the same model over a whole-sequence KVarN cache of the backend's preset
    def reference(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        from kvarn_compile.hf import KVarNCache
        from kvarn_compile.testing.models import cache_arg

        cache = KVarNCache(self.q.config, max_cache_len=self.max_len, preset=self.backend.config)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kv_logits = self.q(ids, **cache_arg(self.q, cache)).logits
            return self.fp(ids).logits[:, start:], kv_logits[:, start:]

    def _cropped(self, ids: torch.Tensor, drop: int, more: torch.Tensor) -> torch.Tensor:
        """Logits of ``more`` after ``ids`` went into an eager KVarN cache cropped by ``drop``."""
        from kvarn_compile.hf import KVarNCache
        from kvarn_compile.testing.models import cache_arg

        cache = KVarNCache(self.q.config, max_cache_len=self.max_len, preset=self.backend.config)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.q(ids, **cache_arg(self.q, cache))
            cache.crop(-drop)
            return self.q(more, **cache_arg(self.q, cache)).logits

    def _assisted(self, ids: torch.Tensor, new: int, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, logits) of the same assisted ``generate`` on an eager KVarN cache: drafts
        rejected out of a tile they completed are revised there too (the tile's other tokens
        go back to the tail dequantized and are quantized again), which the preset's error
        over a whole-sequence cache does not include."""
        from kvarn_compile.hf import KVarNCache
        from kvarn_compile.testing.models import cache_arg

        cache = KVarNCache(self.q.config, max_cache_len=self.max_len, preset=self.backend.config)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.q.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, **cache_arg(self.q, cache), **kw)
        return out.sequences, torch.stack(out.logits, 1)

    def _ids(self, rng: random.Random, batch: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
        return torch.randint(2, self.vocab, (batch, n), generator=g)

    def _cache(self, kind: str, batch: int):
        from transformers import DynamicCache, StaticCache

        if kind == "static":
            return StaticCache(config=self.model.config, max_cache_len=self.max_len)
        return DynamicCache(config=self.model.config)

    def _forward(self, ids: torch.Tensor, cache: Any, **kw: Any) -> Any:
        from kvarn_compile.testing.models import cache_arg

        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.model(ids, use_cache=True, **cache_arg(self.model, cache), **kw)

    def step(self, rng: random.Random, log: list[str], rtol: float) -> None:
        from kvarn_compile.hf import output_cache
        from kvarn_compile.testing.models import cache_arg, static_cache_crops

        kind = rng.choice(["generate", "generate", "chunks", "deepcopy", "crop", "continue",
                           "eager", "assisted"])
        batch = rng.choice([1, 1, 2])
        cache_kind = rng.choice(["dynamic", "static"])
        if kind == "generate":
            n, new = rng.randint(3, 120), rng.randint(1, 6)
            hidden = rng.random() < 0.3
            static = rng.choice(["none", "implementation", "object"])
            log.append(f"generate(B={batch}, prompt={n}, new={new}, cache={static if static != 'none' else 'dynamic'}"
                       f"{', output_hidden_states' if hidden else ''})")
            ids = self._ids(rng, batch, n)
            kw = dict(max_new_tokens=new, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, output_hidden_states=hidden)
            if static == "implementation":
                kw["cache_implementation"] = "static"
            elif static == "object":
                kw.update(cache_arg(self.model, self._cache("static", batch)))
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = self.model.generate(ids, **kw)
            got = torch.stack(out.logits, 1)
            _compare(got, [x[:, :new] for x in self.reference(out.sequences, n - 1)], rtol, log[-1])
            if output_cache(out) is not None and rng.random() < 0.5:
                self.alive.append((output_cache(out), out.sequences[:, :-1]))
        elif kind == "chunks":
            total = rng.randint(2, 140)
            cuts = sorted(rng.sample(range(1, total), min(rng.randint(0, 3), total - 1)))
            log.append(f"forward chunks {[b - a for a, b in zip([0] + cuts, cuts + [total])]} "
                       f"(B={batch}, {cache_kind})")
            ids = self._ids(rng, batch, total)
            cache = self._cache(cache_kind, batch)
            want = self.reference(ids, 0)
            for a, b in zip([0] + cuts, cuts + [total]):
                got = self._forward(ids[:, a:b], cache).logits
                _compare(got, [x[:, a:b] for x in want], rtol, log[-1] + f" chunk {a}:{b}")
            self.alive.append((cache, ids))
        elif kind == "deepcopy":
            n = rng.randint(2, 120)
            log.append(f"prefill {n} then two continuations of copy.deepcopy (B={batch}, {cache_kind})")
            ids = self._ids(rng, batch, n)
            cache = self._cache(cache_kind, batch)
            self._forward(ids, cache)
            for _ in range(2):
                twin = copy.deepcopy(cache)
                more = self._ids(rng, batch, rng.randint(1, 3))
                full = torch.cat([ids, more], 1)
                got = self._forward(more, twin).logits
                _compare(got, self.reference(full, n), rtol, log[-1])
        elif kind == "crop":
            n = rng.randint(4, 120)
            drop = rng.randint(1, min(n - 1, rng.choice([8, 48])))      # 48: into the tiles
            if cache_kind == "static" and not static_cache_crops():
                cache_kind = "dynamic"
            log.append(f"prefill {n}, crop(-{drop}), continue (B={batch}, {cache_kind})")
            ids = self._ids(rng, batch, n)
            cache = self._cache(cache_kind, batch)
            self._forward(ids, cache)
            cache.crop(-drop)
            keep = ids[:, :n - drop]
            more = self._ids(rng, batch, rng.randint(1, 3))
            got = self._forward(more, cache).logits
            fp, once = self.reference(torch.cat([keep, more], 1), n - drop)
            # the preset's error for this flow: a crop into the tiles keeps the tokens of the
            # tile it lands in as they were quantized (the eager cache, cropped alike)
            cropped = self._cropped(ids, drop, more)
            worse = cropped if (cropped - fp).abs().max() >= (once - fp).abs().max() else once
            _compare(got, (fp, worse), rtol, log[-1])
        elif kind == "continue" and self.alive:
            cache, ids = self.alive.pop(rng.randrange(len(self.alive)))
            more = self._ids(rng, ids.shape[0], rng.randint(1, 2))
            eager = rng.random() < 0.3          # the model's uncompiled forward, in between
            log.append(f"continue a cache of {ids.shape[1]} tokens from an earlier step "
                       f"(B={ids.shape[0]}) with {more.shape[1]}{' uncompiled' if eager else ''}")
            full = torch.cat([ids, more], 1)
            room = _capacity(cache)
            if full.shape[1] >= self.max_len or 0 <= room < full.shape[1]:
                return      # (a static cache generate sized for its own tokens is full)
            with torch.compiler.set_stance("force_eager" if eager else "default"):
                got = self._forward(more, cache).logits
            _compare(got, self.reference(full, ids.shape[1]), rtol, log[-1])
            if rng.random() < 0.5:
                self.alive.append((cache, full))
        elif kind == "assisted":
            n, new = rng.randint(3, 100), rng.randint(2, 8)
            lookup = rng.random() < 0.5
            log.append(f"generate(B=1, prompt={n}, new={new}, "
                       f"{'prompt_lookup_num_tokens=3' if lookup else 'assistant_model=<other weights>'})")
            ids = self._ids(rng, 1, n)
            if lookup:                  # repeated n-grams, so that drafts get proposed
                ids = torch.cat([ids[:, : (n + 1) // 2], ids[:, : n // 2]], 1)
            kw = dict(prompt_lookup_num_tokens=3) if lookup else dict(assistant_model=self.assistant)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = self.model.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True,
                                          return_dict_in_generate=True, **kw)
            got = torch.stack(out.logits, 1)
            k = got.shape[1]
            fp, once = (x[:, :k] for x in self.reference(out.sequences, n - 1))
            # the preset's error for this flow: the same generate on the eager cache (a
            # rollback into a frozen tile quantizes its kept tokens twice), where it chose the
            # same tokens
            tokens, revised = self._assisted(ids, new, kw)
            if torch.equal(tokens, out.sequences) \
                    and (revised - fp).abs().max() > (once - fp).abs().max():
                once = revised
            _compare(got, (fp, once), rtol, log[-1])
        else:
            n = rng.randint(1, 40)
            log.append(f"eager forward of {n} tokens (uncompiled, own cache)")
            ids = self._ids(rng, 1, n)
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                got = self.model(ids).logits
            fp = self.reference(ids, 0)[0]
            _compare(got, (fp, fp), 1e-4, log[-1])
        del self.alive[:-4]


def _attend(q, k, v, k_cache, v_cache, pos: int, window: int | None, brk: bool, config=None,
            newest: bool = False):
    """The helper's attention: write K/V at ``pos`` of caches [B, H, L, D], attend the prefix
    (or the last ``window`` positions once longer), causal over the new tokens. ``config``
    (references only): attend the prefix as a whole-sequence cache of that preset holds it.
    ``newest``: the window spelled as the newest positions of the prefix (``[..., -window:]``)."""
    t = q.shape[2]
    k_cache[:, :, pos:pos + t] = k
    v_cache[:, :, pos:pos + t] = v
    if brk:
        torch._dynamo.graph_break()
    lo = 0 if window is None else max(0, pos + t - window)
    if newest and lo:
        kk, vv = k_cache[:, :, :pos + t][:, :, -window:], v_cache[:, :, :pos + t][:, :, -window:]
    else:
        kk, vv = k_cache[:, :, lo:pos + t], v_cache[:, :, lo:pos + t]
    if config is not None:
        from kvarn_compile.quant.cache import quantize_cache

        kq, vq = quantize_cache(k_cache[:, :, :pos + t], v_cache[:, :, :pos + t], config).dequantize()
        kk, vv = kq[:, :, lo:].to(q.dtype), vq[:, :, lo:].to(q.dtype)
    if t > 1:
        mask = torch.ones(t, pos + t - lo, dtype=torch.bool).tril(pos - lo)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    return F.scaled_dot_product_attention(q, kk, vv)


class HelperSubject:
    """Two "layers" as plain functions sharing one attention helper, over caches the caller
    owns ([B, H, L, D] buffers): no module, so the pass names the sites by source line."""

    name = "helper"

    def __init__(self, backend: Any, heads: int = 2, dim: int = 32, max_len: int = 192,
                 window: int | None = None, graph_break: bool = False, copies: bool = True,
                 newest: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = [torch.randn(3, dim * heads, dim * heads, generator=g) / (dim * heads) ** 0.5
                  for _ in range(2)]
        self.heads, self.dim, self.max_len = heads, dim, max_len
        self.window, self.brk, self.copies, self.newest = window, graph_break, copies, newest
        self.compiled = torch.compile(self._run, backend=backend)
        self.config = backend.config
        #: caches of earlier steps: (compiled side's, the two references', next position)
        self.alive: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]] = []
        self.name = f"helper(window={window}, graph_break={graph_break})"

    def _run(self, x: torch.Tensor, caches: list[torch.Tensor], pos: int, config=None) -> torch.Tensor:
        b, t, _ = x.shape
        h, d = self.heads, self.dim
        for layer in range(2):
            qkv = [(x @ w).view(b, t, h, d).transpose(1, 2) for w in self.w[layer]]
            o = _attend(*qkv, caches[2 * layer], caches[2 * layer + 1], pos, self.window, self.brk,
                        config, self.newest)
            x = x + o.transpose(1, 2).reshape(b, t, h * d)
        return x

    def caches(self, batch: int) -> list[torch.Tensor]:
        return [torch.zeros(batch, self.heads, self.max_len, self.dim) for _ in range(4)]

    def step(self, rng: random.Random, log: list[str], rtol: float) -> None:
        batch = rng.choice([1, 2])
        g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
        if self.alive and rng.random() < 0.4:
            caches, ref_caches, q_caches, pos = self.alive.pop(rng.randrange(len(self.alive)))
            batch = caches[0].shape[0]
            log.append(f"continue caches at {pos} (B={batch})")
        else:
            caches, pos = self.caches(batch), 0
            ref_caches, q_caches = self.caches(batch), self.caches(batch)
            if self.copies and rng.random() < 0.3:
                # the caller copies a filled cache into a longer one, in plain torch
                n = rng.randint(2, 100)
                x = torch.randn(batch, n, self.heads * self.dim, generator=g)
                log.append(f"prefill {n} into other caches, copied into new ones (B={batch})")
                other = self.caches(batch)
                self.compiled(x, other, 0)
                self._run(x, ref_caches, 0)
                self._run(x, q_caches, 0, self.config)
                for a, b in zip(caches, other):
                    a.copy_(b)
                pos = n
        for _ in range(rng.randint(1, 3)):
            t = rng.choice([1, 1, rng.randint(2, 70)])
            if pos + t > self.max_len:
                break
            x = torch.randn(batch, t, self.heads * self.dim, generator=g)
            eager = pos > 0 and rng.random() < 0.2      # the uncompiled helper, in between
            log.append(f"{t} tokens at {pos}{' uncompiled' if eager else ''}")
            got = (self._run if eager else self.compiled)(x, caches, pos)
            want = self._run(x, ref_caches, pos), self._run(x, q_caches, pos, self.config)
            _compare(got, want, rtol, log[-1])
            pos += t
        self.alive.append((caches, ref_caches, q_caches, pos))
        del self.alive[:-3]


def run_flows(subject: Any, flows: int, *, seed: int = 0, steps: int = 3,
              rtol: float = 0.005, first: int = 0) -> list[Finding]:
    """Run random flows ``first .. first + flows - 1`` of up to ``steps`` steps on
    ``subject``; the findings."""
    findings = []
    for f in range(first, first + flows):
        flow_seed = seed * 100_003 + f
        rng = random.Random(flow_seed)
        log: list[str] = []
        for _ in range(rng.randint(1, steps)):
            try:
                subject.step(rng, log, rtol)
            except AssertionError as err:
                findings.append(Finding(flow_seed, list(log), f"silently wrong: {err}"))
                break
            except Exception as err:  # noqa: BLE001  (a finding, reported with its seed)
                if _refusal(err):
                    log.append(f"refused: {str(err).strip().splitlines()[0][:160]}")
                    continue
                tb = traceback.format_exception_only(type(err), err)[-1].strip()
                findings.append(Finding(flow_seed, list(log), f"crashed: {tb[:400]}"))
                break
    return findings
