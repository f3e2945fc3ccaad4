"""Where every KV byte lives: the one description of page, payload and handoff buffer shapes.

Device pages (per pipeline stage s, holding layers `stage_layers(s)`):
    pages[s]: [num_blocks, layers_in_stage, 2 (k, v), block_size, num_kv_heads, head_dim]
Block-major, so one block of one stage (all its layers, K and V) is one contiguous span: a store chunk
(`chunk_tokens`, 16 blocks by default) packs into one buffer with a single gather. Block ids are shared across stages: one block
table per sequence covers every stage.

Store payload for one (chunk, stage): pages[s][chunk block ids] -> [n_blocks, Ls, 2, B, H, D] contiguous.

Handoff buffer for decode rank r of N (context parallelism N: rank r holds tokens t with t % N == r,
at local position t // N, for all layers): [tokens_of_rank, num_layers, 2, H, D], token-major.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from shared.hashing import BLOCK_TOKENS, CHUNK_TOKENS


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    stages: int = 1
    block_size: int = BLOCK_TOKENS
    chunk_tokens: int = CHUNK_TOKENS  # tokens per store object (a multiple of block_size)

    def __post_init__(self) -> None:
        if not 1 <= self.stages <= self.num_layers:
            raise ValueError(f"stages must be in [1, {self.num_layers}], got {self.stages}")
        if self.chunk_tokens < self.block_size or self.chunk_tokens % self.block_size:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} must be a positive multiple of the block size "
                             f"{self.block_size}")

    def stage_layers(self, stage: int) -> range:
        """Contiguous layer span of a stage; earlier stages take the remainder layers."""
        base, extra = divmod(self.num_layers, self.stages)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    def stage_of_layer(self, layer: int) -> tuple[int, int]:
        """(stage, index of the layer within that stage)."""
        for s in range(self.stages):
            span = self.stage_layers(s)
            if layer in span:
                return s, layer - span.start
        raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")

    def page_shape(self, stage: int, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, len(self.stage_layers(stage)), 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.elem_bytes

    def stage_bytes_per_token(self, stage: int) -> int:
        return len(self.stage_layers(stage)) * 2 * self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer (K and V): one block of a single-stage page."""
        return self.block_size * self.bytes_per_token

    def stage_block_bytes(self, stage: int) -> int:
        """Bytes of one block of stage `stage`'s page (its layers only)."""
        return self.block_size * self.stage_bytes_per_token(stage)

    def stage_offset_in_block(self, stage: int) -> int:
        """Where stage `stage`'s bytes of a block start inside the same block of a single-stage page."""
        return self.stage_layers(stage).start * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def block_layout(self) -> list:
        """What fixes the meaning of a block's bytes (not how pages are split in stages): two engines
        whose values are equal can copy blocks to each other byte for byte (the direct handoff)."""
        return [self.num_layers, self.num_kv_heads, self.head_dim, str(self.dtype), self.block_size]

    def chunk_payload_bytes(self, stage: int) -> int:
        return self.chunk_tokens * self.stage_bytes_per_token(stage)

    def fingerprint(self, model_id: str, tenant_salt: str = "") -> str:
        """Namespace for hashes and store keys: differs whenever KV bytes could differ in meaning. Not with how
        the pages are split: a block means the same tokens whatever the stages (or context-parallel ranks) that
        hold it, so a prefill of P stages and a decode of one name the same blocks alike (decode reuse), and a
        pool object's key names its stage split itself (`{namespace}/s{stage}of{stages}/...`)."""
        spec = "|".join(
            str(x)
            for x in (model_id, str(self.dtype), self.num_layers, self.num_kv_heads, self.head_dim,
                      self.block_size, self.chunk_tokens, tenant_salt, "layout-v2")
        )
        return "mrg1-" + hashlib.blake2b(spec.encode(), digest_size=8).hexdigest()


def allocate_pages(layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """One page tensor per stage. Zero-filled so never-written slots are deterministic."""
    return [_zeros(layout.page_shape(s, num_blocks), layout.dtype, torch.device(device))
            for s in range(layout.stages)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on CPU through calloc (numpy.zeros): a large block comes from fresh mmap pages
    the kernel zeroes on first touch, so nothing is written now. torch.zeros writes every page at once
    (4 GiB of KV: 4 s of an engine's start-up on a busy host) and commits it all up front."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
