"""GGUF vocabularies (``tokenizer.ggml.*``) → ``tokenizers.Tokenizer``: gpt2 byte-level BPE equals
the tokenizer it was written from, llama SPM merges by score with byte fallback, ``none``
takes ids, bad metadata is refused naming the key."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from prepare.gguf_tokenizer import GgufTokenizerError, tokenizer_from_gguf
from tests.gguf_util import CORPUS, train_tokenizer

TEXTS = ["Hello, world! the experts hold the router.", "a mixture of experts model routes each token",
         "quick brown   fox; lazy dog.", CORPUS[:300]]


def _gpt2_meta(tok: Tokenizer) -> dict:
    import json

    data = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(tokens)
    for a in data["added_tokens"]:
        types[a["id"]] = 3 if a["special"] else 4
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]}


def test_gpt2_vocabulary_round_trips_the_trained_tokenizer():
    tok = train_tokenizer()
    back = tokenizer_from_gguf(_gpt2_meta(tok))
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert back.encode(text).ids == ids
        assert back.decode(ids) == text
    eos = tok.token_to_id("<|endoftext|>")
    assert back.encode("dog<|endoftext|>").ids[-1] == eos
    assert back.decode(back.encode("dog<|endoftext|>").ids) == "dog"  # special tokens skipped


def _spm_meta(**extra) -> dict:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = {"▁": -1.0, "H": -9, "e": -9, "l": -9, "o": -9, "w": -9, "r": -9, "d": -9, "▁H": -5, "▁w": -5,
             "ll": -4, "llo": -3, "▁He": -4.5, "▁Hello": -1.5, "or": -6, "ld": -5, "▁wor": -4, "▁world": -2.0}
    tokens = pieces + list(words)
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * len(pieces) + list(map(float, words.values()))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, **extra}


def test_llama_spm_vocabulary_merges_by_score_with_byte_fallback():
    meta = _spm_meta()
    tok = tokenizer_from_gguf(meta)
    enc = tok.encode("Hello world")
    assert enc.tokens == ["<s>", "▁Hello", "▁world"]  # BOS added (add_bos_token defaults to true)
    assert tok.decode(enc.ids) == "Hello world"
    enc = tok.encode("Hé")
    assert enc.tokens == ["<s>", "▁H", "<0xC3>", "<0xA9>"]  # é is not a piece: its UTF-8 bytes
    assert tok.decode(enc.ids) == "Hé"
    no_bos = tokenizer_from_gguf(_spm_meta(**{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.encode("Hello").tokens == ["▁Hello"]


def test_no_vocabulary_means_token_ids():
    assert tokenizer_from_gguf({"tokenizer.ggml.model": "none"}) is None
    assert tokenizer_from_gguf({}) is None


def test_bad_vocabulary_metadata_is_refused_naming_the_key():
    with pytest.raises(GgufTokenizerError) as exc:
        tokenizer_from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    assert exc.value.key == "tokenizer.ggml.model"
    with pytest.raises(GgufTokenizerError) as exc:
        tokenizer_from_gguf({**_spm_meta(), "tokenizer.ggml.token_type": [1, 2]})
    assert exc.value.key == "tokenizer.ggml.token_type"
    with pytest.raises(GgufTokenizerError) as exc:
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                             "tokenizer.ggml.merges": ["a b c"]})
    assert exc.value.key == "tokenizer.ggml.merges"


def test_gpt2_vocabulary_without_merges_is_byte_level():
    """gguf-py's writer drops an empty ``merges`` array: such a file's tokenizer is the byte-level
    BPE without merges it was written from (bench_serving's, token id = byte value)."""
    tokens = ["a", "b", "c"]
    tok = tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens})
    assert tok.encode("cab").ids == [2, 0, 1]
