"""An engine-level check for an attention backend (tests/test_triton_kernels.py, tests/test_aiter_kernels.py): the
tiny model's engine answering two rounds of prompts, greedily, with the backend in every layer."""

from __future__ import annotations

import torch


def greedy_two_rounds(loaded, attention=None) -> tuple[list, list]:
    """(output ids, device-cached prompt tokens) per round: ragged prompts (5, 40, 300 tokens) in chunked prefill
    of 128 tokens a step (later chunks query behind their own earlier ones), then each prompt with 24 more tokens
    behind the first round's cached prefix, 8 tokens of batched decode each. `attention`: an AttentionKernels to
    put in the model's place (None: the torch reference, kernels/attention_reference.py)."""
    from kernels import AttentionKernels, attention_reference
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(4)
    first = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 300)]
    second = [p + torch.randint(0, loaded.config.vocab_size, (24,), generator=g).tolist() for p in first]
    engine = Engine(loaded, EngineConfig(num_blocks=96, max_batched_tokens=128, long_prefill_tokens=0))
    engine.model.attention = attention or AttentionKernels("reference", attention_reference.paged_decode,
                                                           attention_reference.paged_prefill)
    out, cached = [], []
    for prompts in (first, second):
        seqs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        out.append([s.output_ids for s in seqs])
        cached.append([s.num_device_cached for s in seqs])
    return out, cached
