"""A GGUF file's vocabulary (``tokenizer.ggml.*``) as a ``tokenizers.Tokenizer``.

Kinds (``tokenizer.ggml.model``), as llama.cpp's ``llama-vocab.cpp`` reads them:

* ``gpt2``: byte-level BPE from ``tokenizer.ggml.tokens`` (ids = positions) and
  ``tokenizer.ggml.merges`` (``"a b"``, rank = position); the pre-tokenizer split is
  ``tokenizer.ggml.pre``'s regex (``qwen2``, ``llama-bpe``/``llama3``, ``deepseek-v3``;
  others get GPT-2's), then byte-level;
* ``llama``: SentencePiece BPE from ``tokens`` and ``tokenizer.ggml.scores``: merges are
  every pair of pieces whose concatenation is a piece, ranked by that piece's score (as
  transformers' ``SentencePieceExtractor``), byte fallback on the ``<0xXX>`` pieces, spaces
  as ``▁`` with a prefix space unless ``tokenizer.ggml.add_space_prefix`` is false;
* ``none`` (or no tokens): no tokenizer, the model takes token ids.

Token types (``tokenizer.ggml.token_type``) 3 (control), 4 (user-defined) and 5 (unused: the
converter's ``[PADi]`` fillers) become added tokens (control and unused ones special: skipped
when decoding, as llama.cpp prints nothing for them); ``tokenizer.ggml.add_bos_token`` (default
true for ``llama``, false for ``gpt2``) prepends ``bos_token_id`` when encoding.

Pure Python (``tokenizers``); imports nothing from Django.
"""
from __future__ import annotations

from typing import Mapping

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "deepseek-v3": r"\p{N}{1,3}|[一-龥぀-ゟ゠-ヿ]+|[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
                   r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5


class GgufTokenizerError(ValueError):
    """The vocabulary metadata is inconsistent; ``key`` names the GGUF key."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def _list(meta: Mapping, key: str, n: int | None, required: bool = True) -> list | None:
    v = meta.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, list) or (n is not None and len(v) != n):
        want = f"a list of {n} entries" if n is not None else "a list"
        raise GgufTokenizerError(f"GGUF {key} must be {want}", key)
    return v


def tokenizer_from_gguf(meta: Mapping):
    """The ``tokenizers.Tokenizer`` of GGUF metadata ``meta``, or None for ``none`` / no tokens.

    Raises ``GgufTokenizerError`` naming the key for an unknown ``tokenizer.ggml.model``
    (only ``gpt2``, ``llama``, ``none``), lists of mismatched lengths, or a bad merge.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind in (None, "none") or not tokens:
        return None
    if kind not in ("gpt2", "llama"):
        raise GgufTokenizerError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (gpt2, llama, none)",
                                 "tokenizer.ggml.model")
    tokens = _list(meta, "tokenizer.ggml.tokens", None)
    n = len(tokens)
    types = _list(meta, "tokenizer.ggml.token_type", n, required=False) or [1] * n
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate piece keeps its first id (llama.cpp maps text -> first)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < n else None
    if kind == "gpt2":
        merges = []
        # No key: a byte-level BPE without merges (gguf-py's writer drops an empty array).
        for j, m in enumerate(_list(meta, "tokenizer.ggml.merges", None, required=False) or []):
            parts = m.split(" ")
            if len(parts) != 2:
                raise GgufTokenizerError(f"GGUF tokenizer.ggml.merges[{j}]={m!r} is not two pieces",
                                         "tokenizer.ggml.merges")
            merges.append((parts[0], parts[1]))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        pre = meta.get("tokenizer.ggml.pre")
        split = _SPLITS.get("llama-bpe" if pre == "llama3" else pre, _GPT2_SPLIT)
        from tokenizers import Regex

        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    else:
        scores = _list(meta, "tokenizer.ggml.scores", n, required=False) or [0.0] * n
        ranked = []
        for piece, pid in vocab.items():
            if types[pid] != 1 or len(piece) < 2:
                continue
            for k in range(1, len(piece)):
                a, b = piece[:k], piece[k:]
                if a in vocab and b in vocab:
                    ranked.append((-scores[pid], pid, vocab[a], vocab[b], a, b))
        ranked.sort()
        merges = [(a, b) for *_, a, b in ranked]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        steps = [normalizers.Replace(" ", "▁")]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(steps)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)]
                                           if meta.get("tokenizer.ggml.add_space_prefix", True) else []))
        add_bos_default = True
    added = [AddedToken(t, special=types[i] != USER_DEFINED, normalized=False)
             for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED, UNUSED) and vocab.get(t) == i]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", add_bos_default) and isinstance(bos, int) and 0 <= bos < n:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                           pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], bos)])
    return tok
