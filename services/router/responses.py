"""OpenAI response shapes: chat.completion(.chunk), text_completion, usage, and SSE framing."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from shared.messages import TokenChunk

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def make_usage(final: TokenChunk | None, prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI usage + moorage's breakdown, from the final chunk's `usage` (counted here when absent)."""
    got = (final.usage if final is not None else None) or {}
    prompt = int(got.get("prompt_tokens", prompt_tokens))
    completion = int(got.get("completion_tokens", completion_tokens))
    src = dict(got.get("moorage") or {})
    if not src:
        cached = int((got.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
        src = {"device": cached, "store": 0, "computed": prompt - cached}
    breakdown = {k: int(src.get(k, 0) or 0) for k in ("device", "store", "computed")}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": breakdown["device"] + breakdown["store"]},
        "moorage": breakdown,
    }


@dataclass
class Shaper:
    """Builds the objects of one response; `chat` picks chat.completion vs text_completion shapes."""
    chat: bool
    request_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id.removeprefix("req-")

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            return {**self._base("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage}

    def _chunk(self, choice: dict) -> dict:
        obj = {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None
        return obj

    def role_chunk(self) -> dict:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta_chunk(self, text: str, finish_reason: str | None = None) -> dict:
        if self.chat:
            delta = {"content": text} if text else {}
            return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason})
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason})

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage}
