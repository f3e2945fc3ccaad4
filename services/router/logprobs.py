"""Per-token log-probabilities in OpenAI's shapes, from what the engines sent with the tokens
(shared/engine/sampling.TokenLogprob: the chosen token's log-probability and the most likely alternatives).

Chat Completions (`logprobs: true`, `top_logprobs: n`): `{"content": [{token, logprob, bytes, top_logprobs}]}`,
`bytes` being the token's own UTF-8 bytes (a token that holds part of a character has just that part, and its
`token` text is then "bytes:\\xe2\\x80", as OpenAI writes it). Completions (`logprobs: n`): `{tokens,
token_logprobs, top_logprobs, text_offset}`, each offset the characters of the answer before the token (a
character split over tokens counts once, where it completes; a special token, which the text leaves out, none).
"""

from __future__ import annotations

import codecs

from shared.engine.sampling import TokenLogprob
from shared.engine.tokenizer import Tokenizer

Pairs = list[tuple[int, TokenLogprob]]  # (token id, its log-probabilities)


class LogprobRender:
    def __init__(self, tokenizer: Tokenizer):
        self.token_bytes = tokenizer.token_bytes
        self.specials = frozenset(tokenizer.special_tokens.values())  # not in the answer's text
        self.offset = 0  # completions: characters of the answer's tokens rendered so far
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds a character's first bytes

    def text(self, token_id: int) -> str:
        """The token's text; a token that is not whole UTF-8 (part of a character) is written as its bytes,
        "bytes:\\xe2\\x80", as OpenAI writes them, so distinct tokens never share a text."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.text(token_id), "logprob": logprob, "bytes": list(self.token_bytes(token_id))}

    def chat(self, pairs: Pairs) -> dict:
        return {"content": [{**self._entry(t, lp.logprob), "top_logprobs": [self._entry(a, v) for a, v in lp.top]}
                            for t, lp in pairs]}

    def completion(self, pairs: Pairs) -> dict:
        tokens = [self.text(t) for t, _ in pairs]
        offsets = []
        for t, _ in pairs:
            offsets.append(self.offset)
            if t not in self.specials:
                self.offset += len(self._utf8.decode(self.token_bytes(t)))
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in pairs],
                "top_logprobs": [{self.text(a): v for a, v in lp.top} for _, lp in pairs], "text_offset": offsets}
