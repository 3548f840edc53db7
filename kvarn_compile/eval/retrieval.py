"""Key-value retrieval under pseudo-decode: does the quantized model still read back a list?

A prompt is a record of lines, each giving one key a random 4-digit code
(``The secret code of lantern is 4821.``; every key is a different common noun), followed by
a question for one key; the answer is primed with ``The secret code of lantern is `` so the
greedy tokens are the digits. The record is pseudo-decoded in blocks of ``b`` tokens
(:class:`~.harness.PseudoQuantCache`), then the question is one more block and the answer is
decoded greedily, token by token, through the same cache. The score is the *agreement* of
the quantized model's answer with the full-precision model's answer (both run through the
same block-wise code; method "none" is the full-precision model), and the accuracy against
the true code.

The format was chosen for the small default model: with numbered lines
(``line 17: REGISTER_CONTENT is <4821>``) SmolLM2-135M answers almost nothing even in full
precision (0 to 1 of 6 at 10 to 40 lines, with several question formats), so agreement
there measured nothing; with word keys it answers 5 of 6 at 20 and at 40 lines (about 300
and 570 tokens), 3 of 6 at 60 lines and 1 of 6 at 100 (seed 0). Each length's result says whether the
full-precision model solves it (``fp_solves``: accuracy >= :data:`FP_SOLVES`); where it does
not, agreement mostly compares two wrong answers, and the summary says so.

The record is shared by the questions of one prompt: it is pseudo-decoded once per method
and the cache state is snapshotted and restored for every question.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Sequence

import torch

from kvarn_compile.config import KVarNConfig

from .harness import PseudoQuantCache, method_config, run_blocks

__all__ = ["RetrievalPrompt", "build_prompts", "greedy_answer", "retrieval_eval", "KEYS", "FP_SOLVES"]

#: The full-precision model "solves" a record length when it answers at least this share.
FP_SOLVES = 0.5

_MARK = "\u241fQUESTION\u241f"
_INTRO = "Here is a list of secret codes, one per line.\n\n"
_LINE = "The secret code of {key} is {value}."
_QUESTION = "What is the secret code of {key}?"
_PRIME = "The secret code of {key} is "

#: Distinct keys of the record lines (common nouns); a record has at most this many lines.
KEYS: tuple[str, ...] = tuple("""
apple river candle forest hammer violin planet rabbit silver window garden pencil mirror
rocket basket castle dragon feather island jacket kettle ladder magnet needle orange pepper
quartz saddle tunnel umbrella velvet walnut yogurt zipper anchor bottle cactus dolphin engine
falcon glacier harbor igloo jungle koala lantern meadow nectar oyster parrot quiver radish
sprout tiger bucket carpet desert helmet lemon marble napkin ocean pillow rainbow spider
teapot valley wallet acorn blanket cherry donkey elbow fountain giraffe hockey insect jigsaw
kitten lobster muffin noodle octopus pumpkin quilt robot salmon tomato unicorn vulture
whistle banana camera diamond eagle finger goose honey iron jelly kiwi lizard monkey nickel
onion panda raven sailor turtle violet wizard badger cobra dinner easel fiddle gravel hippo
ivory jasmine kayak lentil mango nutmeg orchid peanut rhino sofa tulip vessel walrus
""".split())


@dataclasses.dataclass
class RetrievalPrompt:
    """One record of ``n_lines`` lines and the questions asked about it."""

    n_lines: int
    seed: int
    values: list[int]
    prefix_ids: torch.Tensor                 # [1, P]: everything before the question
    questions: list[tuple[int, torch.Tensor]]  # (line number, ids [1, Q] of question + turn end)


def _encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)


def _render(tokenizer, content: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return content + "\nAnswer: "


def build_prompts(tokenizer, n_lines: int, *, n_prompts: int = 1, n_questions: int = 4,
                  seed: int = 0) -> list[RetrievalPrompt]:
    """Random records of ``n_lines`` lines (seeded) with ``n_questions`` distinct questions each."""
    if not 1 <= n_lines <= len(KEYS):
        raise ValueError(f"Expected 1 <= n_lines <= {len(KEYS)} (one distinct key per line), but "
                         f"got {n_lines}.")
    prompts = []
    for p in range(n_prompts):
        s = seed * 1_000_003 + n_lines * 1_009 + p
        rng = random.Random(s)
        keys = rng.sample(KEYS, n_lines)
        values = [rng.randint(1000, 9999) for _ in range(n_lines)]
        record = "\n".join(_LINE.format(key=k, value=v) for k, v in zip(keys, values))
        rendered = _render(tokenizer, _INTRO + record + "\n\n" + _MARK)
        before, after = rendered.split(_MARK)
        asked = rng.sample(range(1, n_lines + 1), min(n_questions, n_lines))
        # the answer is primed up to the number, so the greedy tokens are the retrieved digits
        questions = [(line, _encode(tokenizer, _QUESTION.format(key=keys[line - 1]) + after
                                    + _PRIME.format(key=keys[line - 1])))
                     for line in asked]
        prompts.append(RetrievalPrompt(n_lines=n_lines, seed=s, values=values,
                                       prefix_ids=_encode(tokenizer, before), questions=questions))
    return prompts


@torch.no_grad()
def greedy_answer(model, cache, question_ids: torch.Tensor, max_new_tokens: int,
                  stop_ids: Sequence[int] = ()) -> list[int]:
    """Feed the question as one block, then decode greedily one token per step."""
    logits = None
    for _, _, logits in run_blocks(model, question_ids, cache, question_ids.shape[-1],
                                   logits_to_keep=1):
        pass
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        tokens.append(token)
        if token in stop_ids or len(tokens) == max_new_tokens:
            break
        for _, _, logits in run_blocks(model, torch.tensor([[token]]), cache, 1, logits_to_keep=1):
            pass
    return tokens


def _number(text: str) -> int | None:
    m = re.search(r"\d{4}", text)
    return int(m.group()) if m else None


@torch.no_grad()
def retrieval_eval(model, tokenizer, *, line_counts: Sequence[int] = (100, 300),
                   methods: Sequence[str] = ("kivi", "hadamard", "kvarn"),
                   presets: Sequence[str | KVarNConfig] = ("k2v2",), block: int = 128,
                   n_prompts: int = 1, n_questions: int = 4, max_new_tokens: int = 6,
                   seed: int = 0, rule: str = "after_block",
                   progress: Callable[[str], None] | None = None) -> dict:
    """Agreement of each method's greedy answers with the fp model's, per record length.

    Returns a JSON-ready dict: per line count, the prompt length in tokens, the fp model's
    accuracy, and per preset and method: ``exact`` (whole answer equal to fp's),
    ``token_agreement`` (share of fp's answer tokens reproduced position by position),
    ``value_agreement`` (same 4-digit number as fp's answer) and ``accuracy`` (the true value).
    """
    stop = [t for t in (tokenizer.eos_token_id, getattr(tokenizer, "pad_token_id", None)) if t is not None]
    stop += [i for i in tokenizer("\n", add_special_tokens=False)["input_ids"][-1:]]
    out: dict = {"settings": {"line_counts": list(line_counts), "n_prompts": n_prompts,
                              "n_questions": n_questions, "max_new_tokens": max_new_tokens,
                              "seed": seed, "block": block, "rule": rule,
                              "presets": [p if isinstance(p, str) else p.short() for p in presets],
                              "methods": list(methods)},
                 "by_lines": {}}
    for n_lines in line_counts:
        prompts = build_prompts(tokenizer, n_lines, n_prompts=n_prompts, n_questions=n_questions,
                                seed=seed)
        answers: dict[tuple[str, str], list[list[int]]] = {}
        runs = [("fp", "none", None)] + [(p if isinstance(p, str) else p.short(), m,
                                          method_config(m, p)) for p in presets for m in methods
                                         if m != "none"]
        for preset_name, method, config in runs:
            if progress is not None:
                progress(f"retrieval {n_lines} lines {method} {preset_name}")
            got = []
            for prompt in prompts:
                cache = PseudoQuantCache(model, config, rule=rule)
                for _ in run_blocks(model, prompt.prefix_ids, cache, block, logits_to_keep=1):
                    pass
                snap = cache.snapshot()
                for _, q_ids in prompt.questions:
                    cache.restore(snap)
                    got.append(greedy_answer(model, cache, q_ids, max_new_tokens, stop))
            answers[(preset_name, method)] = got
        truth = [prompt.values[line - 1] for prompt in prompts for line, _ in prompt.questions]
        fp = answers[("fp", "none")]
        fp_text = [tokenizer.decode(a, skip_special_tokens=True) for a in fp]
        fp_accuracy = sum(_number(t) == v for t, v in zip(fp_text, truth)) / len(fp)
        entry = {"prompt_tokens": [int(p.prefix_ids.shape[-1]) for p in prompts],
                 "questions": len(fp), "fp_accuracy": fp_accuracy,
                 "fp_solves": fp_accuracy >= FP_SOLVES,
                 "fp_answers": fp_text[:8], "truth": truth[:8], "presets": {}}
        for (preset_name, method), got in answers.items():
            if method == "none":
                continue
            text = [tokenizer.decode(a, skip_special_tokens=True) for a in got]
            exact = [a == f for a, f in zip(got, fp)]
            tok_agree = [sum(x == y for x, y in zip(a, f)) / max(len(f), 1) for a, f in zip(got, fp)]
            val_agree = [_number(t) == _number(f) for t, f in zip(text, fp_text)]
            acc = [_number(t) == v for t, v in zip(text, truth)]
            entry["presets"].setdefault(preset_name, {})[method] = {
                "exact": sum(exact) / len(exact), "token_agreement": sum(tok_agree) / len(tok_agree),
                "value_agreement": sum(val_agree) / len(val_agree), "accuracy": sum(acc) / len(acc),
                "answers": text[:8]}
        out["by_lines"][str(n_lines)] = entry
    return out
