"""The text of a sequence as it is generated: incremental detokenization and stop sequences
(OpenAI semantics), one ``Detokenizer`` per sequence, fed by the scheduler's step.

Text settles only when it is final:

- **Complete characters.** A byte-level or byte-fallback vocabulary splits one character
  over several tokens; decoding a prefix then ends in U+FFFD. Text ending so is held back
  until the character completes (or the sequence ends), so a stream never sends a
  replacement character and then the character again. The window of the last decode is kept
  small as vLLM's incremental detokenizer does (``prefix``/``read`` offsets): a new token's
  text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``, which also keeps a leading
  space that decoding the new token alone would strip (SentencePiece ``▁``).
- **Stop sequences.** A stop string is matched on the decoded text, across token
  boundaries; the text ends where the first occurrence starts, the stop string and anything
  after it are left out (OpenAI). Text that could still become the start of a stop string is
  held back until it cannot. A stop token id ends the sequence with its own text left out.

``text`` is what settled so far: an SSE stream sends its growth, the whole answer sends it
once the sequence finished. The generated ids (``Sequence.output``) keep every token, stop
tokens included (``token_ids``, ``usage``).
"""
from __future__ import annotations

from typing import Callable, Sequence

MAX_STOP_CHARS = 256  # characters of one stop string (each token checks the held-back tail against all)


class Detokenizer:
    """The settled text of one sequence's output.

    ``decode(ids) -> str`` (a tokenizer's decode, special tokens skipped, or the ids written
    out); ``stop_ids``: token ids that end the sequence; ``stop_strings``: non-empty strings
    that end it when they occur in the text. ``push(token)`` takes each new id and says
    whether a stop ended the sequence; ``flush()`` settles the held-back tail when it ended
    otherwise (``max_new_tokens``, the context). ``text``: the settled text.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop_ids: Sequence[int] = (),
                 stop_strings: Sequence[str] = ()):
        self.decode = decode
        self.stop_ids = frozenset(stop_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.text = ""
        self._pending = ""  # decoded, complete characters that may still start a stop string
        self._prefix = self._read = 0  # vLLM's offsets: decode window start, ids already read

    def push(self, token: int) -> bool:
        """Take the next generated id; True when a stop ended the sequence here (``text`` is
        then final and leaves the stop out)."""
        if token in self.stop_ids:
            self._settle(self._new_text(final=True), final=True)
            return True
        self.ids.append(token)
        return self._settle(self._new_text(final=False), final=False)

    def flush(self) -> None:
        """The sequence ended without a stop: settle everything held back."""
        self._settle(self._new_text(final=True), final=True)

    def _new_text(self, final: bool) -> str:
        """Complete characters decoded since the last call (all of them when ``final``)."""
        if self._read == len(self.ids):
            return ""
        before = self.decode(self.ids[self._prefix:self._read])
        after = self.decode(self.ids[self._prefix:])
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def _settle(self, new: str, final: bool) -> bool:
        """Append ``new`` to the held text and settle what no stop string can claim; True
        when a stop string occurs (the text ends before it)."""
        held = self._pending + new
        hits = [i for i in (held.find(s) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text += held[:min(hits)]
            self._pending = ""
            return True
        keep = 0 if final else self._stop_prefix(held)
        self.text += held[:len(held) - keep]
        self._pending = held[len(held) - keep:]
        return False

    def _stop_prefix(self, held: str) -> int:
        """Length of the longest end of ``held`` that is the start of a stop string."""
        best = 0
        if not held:
            return 0
        last = held[-1]
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(held)), best, -1):
                if s[k - 1] == last and held.endswith(s[:k]):
                    best = k
                    break
        return best


def settled_text(detokenizer: Detokenizer, ids: list[int]) -> str:
    """The final text of a whole generated sequence ``ids`` (a fresh ``detokenizer``): what
    ``Detokenizer.text`` holds once the sequence ended (up to the first stop, stop left out)."""
    for t in ids:
        if detokenizer.push(t):
            return detokenizer.text
    detokenizer.flush()
    return detokenizer.text
