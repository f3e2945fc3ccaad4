"""One request's state inside an engine: its tokens, its blocks, and where its prompt came from."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from shared.engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: two requests are never "equal"
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    status: SeqStatus = SeqStatus.WAITING
    # Invariant: KV of token_ids[:num_computed] is in pages at block_table; blocks
    # [0, num_registered_blocks) are full, computed and registered in the prefix index.
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Token-source account for the prompt: prefix-cache hit vs computed here. Of the hit, tokens in
    # `restored_range` (start, end) were brought from the pool just for this request.
    num_device_cached: int = 0
    restored_range: tuple[int, int] = (0, 0)
    # Blocks the caller holds for this request until it is admitted (e.g. just restored from the
    # pool): released right after the prefix match, so they cannot be evicted before it.
    pinned_blocks: list[int] = field(default_factory=list)
    output_text: str = ""
    finish_reason: str | None = None
    prompt_logits: torch.Tensor | None = None  # logits that chose the first token (when recorded)
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per token sampled here (params.logprobs)
    guide: object | None = None  # the grammar's matcher (shared/engine/guide.py) when params.grammar is set
    num_preemptions: int = 0
    # When set, finishing hands the block table's ownership to the caller (e.g. a handoff still
    # reading it) instead of releasing it; the caller must release it.
    retain_kv: bool = False
    # Prefill instances stop a request after its first token (finish reason "prefilled") and hand
    # its KV to decode; implies retain_kv.
    prefill_only: bool = False
    # Seed of this request's block hash chain (its tenant's KV namespace); None: the engine's own.
    hash_seed: bytes | None = None
    # Wall-clock marks (ns) for traces: queued -> first scheduled -> first token.
    arrival_ns: int = field(default_factory=time.time_ns)
    register_limit: int = -1  # full blocks that may enter the prefix index (-1: all); decode: the prompt's (landed) only
    priority: int = 0  # agent hint, higher first: srpf weighs the tokens it has left by priority_weight
    first_scheduled_ns: int = 0
    first_token_ns: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.params = self.params.with_resolved_seed()

    @property
    def num_store_tokens(self) -> int:
        start, end = self.restored_range
        return max(0, min(self.num_device_cached, end) - start)

    def next_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        return self.params.make_generator(len(self.output_ids), device)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
