"""Stop strings: where ``generate(stop_strings=...)`` ends a row, exactly as transformers' ``generate`` does.

transformers stops a row at the first generated token that completes one of the strings in its
decoded text (the string may begin in earlier tokens, the prompt's included, and the token may run
past its end), and keeps that token. Its ``StopStringCriteria`` (public, in ``transformers``) decides
that from the token ids alone, with tables it builds once from the tokenizer's vocabulary. selfspec
asks the same object about each token a step accepts, in order, so a row ends on the very token
transformers' loop would have ended it on, whichever number of tokens the step accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class StopStrings:
    def __init__(self, tokenizer, strings: str | Sequence[str]):
        from transformers import StopStringCriteria

        strings = [strings] if isinstance(strings, str) else list(strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings takes non-empty strings (got {strings!r})")
        if tokenizer is None:
            raise ValueError("stop_strings needs the model's tokenizer: pass tokenizer= to generate()")
        self.strings = strings
        self._criteria = StopStringCriteria(tokenizer, strings)
        self.window = self._criteria.maximum_token_len   # the most tokens one match can span

    def first(self, before: Sequence[int], new: Sequence[int]) -> int | None:
        """The index in ``new`` of the first token that completes a stop string, read after ``before``
        (the row's tokens so far, prompt included); None where none does."""
        seq = list(before[-self.window:]) + list(new)
        start = len(seq) - len(new)
        for i in range(len(new)):
            ids = torch.tensor([seq[max(0, start + i + 1 - self.window): start + i + 1]])
            if bool(self._criteria(ids, None)[0]):
                return i
        return None
