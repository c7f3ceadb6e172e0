"""Token generation over a backbone: prefill, then one token per step with the KV cache;
greedy or sampled (temperature, top-k, top-p, seed), stop ids, several sequences per step.

The sampling order is HF ``generate``'s logits warpers: temperature, then top-k, then
top-p (nucleus, Holtzman et al. 2019: keep the smallest set of most likely tokens whose
probability reaches ``top_p``), then one draw from the softmax.

Pure numpy; imports nothing from Django.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from moe.backbone.common import Backbone, BackboneError, KVCache, MlpFn


@dataclass(frozen=True)
class Sampling:
    """Decoding parameters. ``temperature`` 0 means greedy (argmax); ``top_k`` 0 and
    ``top_p`` 1.0 disable those filters; ``seed`` makes sampling reproducible (sequence
    ``i`` of a batch draws from ``seed + i``); a token in ``stop`` ends its sequence (it is
    kept as the last output id; the site's text leaves it out); a string in ``stop_strings``
    ends it when it occurs in the decoded text (matched by the site's scheduler,
    ``router.detokenize``: this module has no tokenizer). Raises ``BackboneError`` naming
    the field for a bad value.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        def bad(name, why):
            raise BackboneError(f"{name} {why}", name)

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:  # the upper limit is the context's and the site's (check_size)
            bad("max_new_tokens", f"must be an integer ≥ 1, got {self.max_new_tokens!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number ≥ 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer ≥ 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", f"must be an integer ≥ 0, got {self.seed!r}")
        if any(not isinstance(s, int) or s < 0 for s in self.stop):
            bad("stop", "must be a list of token ids ≥ 0")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            bad("stop", "strings must be non-empty")


def next_token(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """One token id from float32 ``logits`` ``[vocab]`` under ``s`` (argmax when greedy).

    In float64 and shifted by the maximum before the temperature divides, so every accepted
    value is safe: a subnormal temperature (``1e-310``) sends the others to ``-inf`` (the
    greedy limit) instead of ``inf - inf = NaN``, and a ``top_p`` below float32's range
    (``1e-300``) keeps the most likely token instead of dropping all of them.
    """
    if s.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # (z - max) / T overflows to -inf for a tiny T: probability 0
        z = (z - z.max()) / s.temperature
    if 0 < s.top_k < z.size:
        kth = np.partition(z, -s.top_k)[-s.top_k]
        z = np.where(z < kth, -np.inf, z)
    if s.top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        p = np.exp(z[order])
        p /= p.sum()
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (np.cumsum(p) - p) >= s.top_p
        drop[0] = False
        z[order[drop]] = -np.inf
    p = np.exp(z)  # the maximum is 0 and always kept: the sum is ≥ 1
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


@dataclass
class Sequence:
    """One sequence being generated: ``prompt`` ids, ``output`` ids, its cache, its RNG,
    ``finish_reason`` (None while running, ``"stop"`` or ``"length"``), ``index`` (its
    prompt's position in the request: a scheduler's sequences gain tokens in any order) and
    ``text`` (its settled text so far, kept by the site's scheduler: ``router.detokenize``)."""

    prompt: np.ndarray
    cache: KVCache
    rng: np.random.Generator
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logits: np.ndarray | None = None
    next_id: int | None = None
    index: int = 0
    text: str = ""


class Generator:
    """Prefill and decode steps over ``backbone`` with ``mlp`` as every layer's MLP.

    ``prefill(prompts)`` runs all prompts together and picks each first new token;
    ``step(seqs)`` feeds every running sequence's last token in one batched forward (so a
    distributed MoE layer sends one batch per holder for the whole step). ``timings`` holds
    ``prefill_ms`` and ``decode_ms`` (wall time).
    """

    def __init__(self, backbone: Backbone, mlp: MlpFn, sampling: Sampling):
        self.backbone, self.mlp, self.sampling = backbone, mlp, sampling
        self.timings = {"prefill_ms": 0.0, "decode_ms": 0.0}

    def _choose(self, seq: Sequence, logits: np.ndarray) -> None:
        tok = next_token(logits, self.sampling, seq.rng)
        seq.output.append(tok)
        if tok in self.sampling.stop:
            seq.finish_reason = "stop"
        elif len(seq.output) >= self.sampling.max_new_tokens or \
                seq.cache.length + 1 > self.backbone.max_position:
            seq.finish_reason = "length"

    def prefill(self, prompts: list[np.ndarray], keep_logits: bool = False) -> list[Sequence]:
        """Start sequences from ``prompts`` (int arrays ``[T_i]``, each non-empty); the first
        new token of each is chosen. Raises ``BackboneError`` (field ``input_ids``) for an
        empty prompt, an id outside the vocabulary or a prompt longer than the context."""
        for p in prompts:
            if p.size == 0:
                raise BackboneError("a prompt needs at least one token", "input_ids")
            if p.size >= self.backbone.max_position:
                raise BackboneError(f"the prompt has {p.size} tokens; the context holds "
                                    f"{self.backbone.max_position} with room for one new token", "input_ids")
        seed = self.sampling.seed
        seqs = [Sequence(np.asarray(p, dtype=np.int64), self.backbone.new_cache(),
                         np.random.default_rng(None if seed is None else seed + i), index=i)
                for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        logits = self.backbone.forward([s.prompt for s in seqs], [s.cache for s in seqs], self.mlp,
                                       all_logits=keep_logits)
        self.timings["prefill_ms"] += (time.perf_counter() - t0) * 1e3
        for s, lg in zip(seqs, logits):
            if keep_logits:
                s.prompt_logits = lg
            self._choose(s, lg[-1])
        return seqs

    def step(self, seqs: list[Sequence]) -> list[Sequence]:
        """One decode step for every unfinished sequence; returns those that advanced."""
        live = [s for s in seqs if s.finish_reason is None]
        if not live:
            return []
        t0 = time.perf_counter()
        logits = self.backbone.forward([np.array([s.output[-1]], dtype=np.int64) for s in live],
                                       [s.cache for s in live], self.mlp)
        self.timings["decode_ms"] += (time.perf_counter() - t0) * 1e3
        for s, lg in zip(live, logits):
            self._choose(s, lg[-1])
        return live

    def run(self, prompts: list[np.ndarray], keep_logits: bool = False, on_tokens=None) -> list[Sequence]:
        """Prefill then step until every sequence finished. ``on_tokens(seqs)`` is called
        after the prefill and after each step with the sequences that gained a token."""
        seqs = self.prefill(prompts, keep_logits)
        if on_tokens:
            on_tokens(seqs)
        while True:
            advanced = self.step(seqs)
            if not advanced:
                return seqs
            if on_tokens:
                on_tokens(advanced)

    def resume(self, seqs: list[Sequence], on_tokens=None) -> list[Sequence]:
        """Continue sequences whose caches were built elsewhere (Prefill → Decode handoff)."""
        while self.step(seqs):
            if on_tokens:
                on_tokens(seqs)
        return seqs
