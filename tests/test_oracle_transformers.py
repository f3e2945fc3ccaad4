"""The independent oracle: Hugging Face transformers loads the same SmolLM2 GGUF by itself and moorage must
agree with it.

transformers reads the file with `gguf_file=`: its own tensor-name mapping and q/k un-permutation, its own
config, its own tokenizer conversion (vocabulary, merges, pre-tokenizer, specials) and the chat template
through its own `apply_chat_template`, and its own Llama math (SDPA attention, contiguous KV cache). Only
the block dequantization itself goes through the same `gguf` package (transformers calls it too).
moorage's side is the router's tokenizer (`load_tokenizer`, what the router tokenizes with) and the
engine (`Engine`: paged KV, prefix cache; each prompt prefilled in one step, the cheapest way on CPU).
Compared on 9 prompts, chat and plain, one of them a 4,442-token chat:
- prompt token ids (chat template + tokenizer),
- the logits that choose the first token (max abs difference <= LOGIT_ATOL),
- greedy continuations, token for token, and their decoded text.
The long prompt's logits are also compared at three earlier cut points from the same single forward pass
of transformers (moorage computes the cut prompts from its prefix cache, so that path is checked too).

LOGIT_ATOL: measured max |moorage - transformers| (fp32, CPU, torch 2.x, transformers 5.x): 2.4e-5 to
4.9e-5 on the short prompts, 1.6e-4 after the 4.4K-token prompt and 2.6e-4 at its 4,000-token cut
(2.8e-4 when moorage prefills in 256-token chunks; the error grows with context: longer fp32 sums in
another order); the logits span about +-30. 1e-3 is 3.6x the worst measured and still far below what a real bug does (a wrong q/k permutation, RoPE base, norm
eps, tokenizer merge or template moves logits by tenths to whole units, and flips greedy tokens). The
test prints the measured numbers (run with -s) so CI logs keep them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.models import load_tokenizer, smollm2_gguf_path
from shared.engine.sampling import SamplingParams
from tests.test_tokenizer import CAPITAL_OF_FRANCE_IDS

pytestmark = pytest.mark.slow

LOGIT_ATOL = 1e-3
GREEDY_TOKENS = 16
LONG_GREEDY_TOKENS = 8
LONG_CUTS = (1024, 2500, 4000)  # earlier prompt lengths whose next-token logits are compared too


def _long_text() -> str:
    lines = []
    for i in range(120):
        lines.append(f"Entry {i}: the harbour master logged {i * 7 % 31} boats at dawn; the tide was "
                     f"{'high' if i % 3 else 'low'}, wind from the {['north', 'east', 'south', 'west'][i % 4]}, "
                     f"and the ledger total reached {i * 113 % 997}.")
    return "Summarise the log below.\n" + "\n".join(lines) + "\nWhich entry had the most boats?"


@dataclass(frozen=True)
class Case:
    name: str
    chat: list | None = None   # messages (chat template) ...
    text: str | None = None    # ... or plain text


CASES = [
    Case("capital", chat=[{"role": "user", "content": "What is the capital of France?"}]),
    Case("code", chat=[{"role": "user", "content": "Write a Python function that reverses a string."}]),
    Case("system-multiturn", chat=[
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7 is a prime number."},
        {"role": "user", "content": "And one larger than 100?"}]),
    Case("unicode-digits", chat=[{"role": "user", "content": "Grüße aus München 🚀: what is 12345 * 678?"}]),
    Case("plain-prose", text="The quick brown fox jumps over the lazy dog. Then it"),
    Case("plain-code", text="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    "),
    Case("plain-digits", text="1, 1, 2, 3, 5, 8, 13, 21, 34,"),
    Case("plain-whitespace", text="  indented\n\tline   with    spaces\n\n\nand <|im_start|> inside"),
    Case("long-chat", chat=[{"role": "user", "content": _long_text()}]),
]
LONG = "long-chat"


@dataclass
class Run:
    ids: list[int]
    logits: torch.Tensor           # next-token logits after the whole prompt
    greedy: list[int]
    cut_logits: dict[int, torch.Tensor]


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    path = smollm2_gguf_path()
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, attn_implementation="sdpa", **{dtype_kw: torch.float32}).eval()
    return tok, model


def hf_ids(tok, case: Case) -> list[int]:
    if case.chat is not None:
        out = tok.apply_chat_template(case.chat, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return tok.encode(case.text, add_special_tokens=False)


@torch.inference_mode()
def hf_run(model, ids: list[int], n: int, cuts: tuple[int, ...] = ()) -> Run:
    """One forward pass over the prompt (logits at every position), then greedy with the KV cache."""
    from transformers import DynamicCache

    out = model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True)
    logits, cache = out.logits[0].float(), out.past_key_values
    greedy = [int(logits[-1].argmax())]
    while len(greedy) < n:
        out = model(input_ids=torch.tensor([[greedy[-1]]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        greedy.append(int(out.logits[0, -1].argmax()))
    return Run(ids, logits[-1].clone(), greedy, {c: logits[c - 1].clone() for c in cuts})


def moorage_ids(tok, case: Case) -> list[int]:
    return tok.chat_token_ids(case.chat) if case.chat is not None else tok.encode(case.text)


@pytest.fixture(scope="module")
def router_tok():
    tok, _ = load_tokenizer("smollm2-135m")  # exactly what the router tokenizes with
    return tok


@pytest.fixture(scope="module")
def reference(hf) -> dict[str, Run]:
    tok, model = hf
    runs = {}
    for case in CASES:
        long = case.name == LONG
        runs[case.name] = hf_run(model, hf_ids(tok, case), LONG_GREEDY_TOKENS if long else GREEDY_TOKENS,
                                 LONG_CUTS if long else ())
    return runs


@pytest.fixture(scope="module")
def moorage(smollm2, router_tok) -> dict[str, Run]:
    """moorage's engine on moorage's own ids: all prompts in one batch, then the long prompt's cut points
    (their prefixes are in the engine's prefix cache by then)."""
    engine = Engine(smollm2, EngineConfig(num_blocks=1024, record_prompt_logits=True, max_batched_tokens=8192,
                                          long_prefill_tokens=0))  # each prompt in one step: 3x faster on CPU
    ids = {c.name: moorage_ids(router_tok, c) for c in CASES}
    params = [SamplingParams(max_tokens=LONG_GREEDY_TOKENS if c.name == LONG else GREEDY_TOKENS, ignore_eos=True)
              for c in CASES]
    seqs = engine.generate([ids[c.name] for c in CASES], params)
    cuts = engine.generate([ids[LONG][:n] for n in LONG_CUTS], SamplingParams(max_tokens=1, ignore_eos=True))
    runs = {c.name: Run(ids[c.name], s.prompt_logits, s.output_ids, {}) for c, s in zip(CASES, seqs)}
    runs[LONG].cut_logits = {n: s.prompt_logits for n, s in zip(LONG_CUTS, cuts)}
    return runs


def test_long_prompt_is_long(reference):
    assert len(reference[LONG].ids) >= 4096


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_prompt_ids_match_transformers_tokenizer_and_template(case, hf, router_tok):
    assert moorage_ids(router_tok, case) == hf_ids(hf[0], case)


def test_capital_of_france_ids_are_transformers_ids(hf):
    """tests/test_tokenizer.py's CAPITAL_OF_FRANCE_IDS: recorded from, and checked against, this oracle."""
    assert hf_ids(hf[0], CASES[0]) == CAPITAL_OF_FRANCE_IDS


def _diffs(reference: dict[str, Run], moorage: dict[str, Run]) -> dict[str, float]:
    out = {}
    for name, ref in reference.items():
        out[name] = float((moorage[name].logits - ref.logits).abs().max())
        for n, lg in ref.cut_logits.items():
            out[f"{name}@{n}"] = float((moorage[name].cut_logits[n] - lg).abs().max())
    return out


def test_prompt_logits_match_within_fp32_tolerance(reference, moorage):
    diffs = _diffs(reference, moorage)
    worst = max(diffs, key=diffs.get)
    print(f"\noracle: max |logit diff| {diffs[worst]:.3e} ({worst}); per prompt: "
          + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert len(diffs) == len(CASES) + len(LONG_CUTS)
    assert diffs[worst] <= LOGIT_ATOL, diffs


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_continuation_matches_token_for_token(case, reference, moorage, hf, router_tok):
    ref, ours = reference[case.name], moorage[case.name]
    assert ours.greedy == ref.greedy
    assert router_tok.decode(ours.greedy) == hf[0].decode(ref.greedy, skip_special_tokens=True)
