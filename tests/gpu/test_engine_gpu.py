"""The engine on a CUDA device, against transformers on the same device.

Weights: the bundled models' files do not reach the device machine (its only inputs are this tree and a few
wheels, 64 MiB a call), so transformers builds SmolLM2's and Gemma 3 270M's exact shapes with seeded random
weights there (tests/random_oracle.py); the real weights' identity is proven on CPU in `make test`
(tests/test_oracle_transformers.py, tests/test_gemma3.py)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kernels import attention_reference, get_attention_kernels, get_kv_kernels
from shared.engine.engine import Engine, EngineConfig
from shared.engine.models import load_model
from shared.engine.sampling import SamplingParams
from tests import random_oracle as oracle

pytestmark = pytest.mark.gpu

NEW_TOKENS = 32
LENGTHS = (7, 100, 700)  # 700 + 32 runs past Gemma 3's 512-token window


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def checkpoint(request, tmp_path_factory):
    model = oracle.build_hf_model(request.param, device="cuda")
    path = oracle.save_hf_model(model, tmp_path_factory.mktemp(request.param))
    model.to("cuda")
    return request.param, model, path


def _engine(path, dtype="float32", num_blocks=1024, **kw) -> Engine:
    return Engine(load_model(str(path)), EngineConfig(device="cuda", dtype=dtype, num_blocks=num_blocks,
                                                      record_prompt_logits=True, **kw))


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_greedy_fp32_equals_transformers_on_device(checkpoint, report):
    shape, model, path = checkpoint
    engine = _engine(path)
    assert engine.model.attention.name == "triton" and engine.pages[0].is_cuda
    prompts = oracle.prompts(oracle.SHAPES[shape]["vocab_size"], LENGTHS)
    want = oracle.hf_greedy(model, prompts, NEW_TOKENS)
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    err = max(float((s.prompt_logits.float().cpu() - oracle.hf_last_logits(model, p)).abs().max())
              for s, p in zip(seqs, prompts))
    report(model=shape, tokens=len(prompts) * NEW_TOKENS, identical=[s.output_ids for s in seqs] == want,
           max_logit_diff=f"{err:.2e}")
    assert [s.output_ids for s in seqs] == want
    assert err < 1e-3


def test_bf16_on_device(checkpoint, report):
    """Compute and KV in bf16: compared with transformers in bf16 (both round, in other orders, so greedy
    paths may part after a while: measured and reported) and with fp32 (the first token's logits)."""
    shape, model, path = checkpoint
    engine = _engine(path, dtype="bfloat16")
    assert engine.pages[0].dtype == torch.bfloat16
    prompts = oracle.prompts(oracle.SHAPES[shape]["vocab_size"], LENGTHS)
    fp32_logits = [oracle.hf_last_logits(model, p) for p in prompts]
    bf16 = model.to(torch.bfloat16)
    try:
        want = oracle.hf_greedy(bf16, prompts, NEW_TOKENS)
    finally:
        model.to(torch.float32)
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    parts = [_first_divergence(s.output_ids, w) for s, w in zip(seqs, want)]
    errs = [float((s.prompt_logits.float().cpu() - f).abs().max()) for s, f in zip(seqs, fp32_logits)]
    spans = [float(f.max() - f.min()) for f in fp32_logits]
    report(model=shape, greedy_agree_until=parts, of=NEW_TOKENS, max_logit_diff_vs_fp32=f"{max(errs):.3f}",
           logit_span=f"{min(spans):.1f}")
    assert all(torch.isfinite(s.prompt_logits).all() for s in seqs)
    assert max(e / s for e, s in zip(errs, spans)) < 0.05  # the same function, to bf16's precision


def test_sampling_on_device_is_seeded(checkpoint, report):
    """Random sampling on device logits with a device generator (top_p too): the same seed gives the same
    tokens, other seeds other tokens. Temperature 3: random weights make peaked logits (Gemma's span ~30),
    where temperature 1 draws the top token nearly always whatever the seed."""
    shape, _, path = checkpoint
    engine = _engine(path)
    prompt = oracle.prompts(oracle.SHAPES[shape]["vocab_size"], (40,), seed=3)
    runs = {}
    for name, seed, top_p in (("a", 7, 1.0), ("a2", 7, 1.0), ("b", 8, 1.0), ("c", 9, 1.0), ("p", 7, 0.9)):
        params = SamplingParams(temperature=3.0, top_p=top_p, seed=seed, max_tokens=24, ignore_eos=True)
        runs[name] = engine.generate(prompt, params)[0].output_ids
    report(model=shape, same_seed_same=runs["a"] == runs["a2"], other_seeds_differ=runs["a"] not in (runs["b"], runs["c"]))
    assert runs["a"] == runs["a2"] and runs["a"] != runs["b"] and runs["a"] != runs["c"] and len(runs["p"]) == 24


def test_engine_throughput_on_device(checkpoint, report):
    """Decode steps of 32 sequences at 2K context and one 4K-token prefill, Triton attention against the
    torch reference in the same engine (figures only: this is a smoke run, the benchmark is bench/)."""
    shape, _, path = checkpoint
    engine = _engine(path, dtype="bfloat16", num_blocks=5000, max_batched_tokens=4096, max_num_seqs=32)
    vocab = oracle.SHAPES[shape]["vocab_size"]
    long_prompt = oracle.prompts(vocab, (4096,), seed=5)
    params1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.generate(oracle.prompts(vocab, (64,), seed=6), params1)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(long_prompt, params1)
    torch.cuda.synchronize()
    prefill_tps = 4096 / (time.perf_counter() - t0)
    ms = {}
    for backend in ("triton", "reference"):
        engine.model.attention = get_attention_kernels("cuda") if backend == "triton" else attention_reference
        ms[backend] = _decode_step_ms(engine, oracle.prompts(vocab, (2048,) * 32, seed=9), 32)
    report(model=shape, prefill_tok_s=round(prefill_tps), decode_step_ms_triton=round(ms["triton"], 2),
           decode_step_ms_reference=round(ms["reference"], 2), decode_tok_s_triton=round(32e3 / ms["triton"]))
    assert ms["triton"] > 0


def _decode_step_ms(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    """The mean time of `steps` decode steps of these prompts together, after their prefill and one decode step
    (which records a CUDA graph's bucket, with engine.cuda_graphs)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"t{len(prompts)}-{i}", p, SamplingParams(temperature=0, max_tokens=steps + 2,
                                                                      ignore_eos=True))
    while any(s.num_computed < len(s.prompt_ids) for s in engine.sequences.values()):
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    while engine.sequences:
        engine.step()
        n += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_replay_the_eager_decode(checkpoint, dtype, report):
    """engine.cuda_graphs: decode replayed from graphs gives the tokens of the same padded batches run eagerly
    (the same kernels on the same shapes), batches shrinking 7 -> 1 through four buckets; in fp32 also the
    tokens of unpadded eager decode and of transformers. Graphs recorded on the first step that needs them
    (cuda_graphs_ahead off) and every bucket recorded at start-up on padding rows (the default) give the same
    tokens, and then no step in service runs eagerly. Then the decode step's time, graphs against eager."""
    shape, model, path = checkpoint
    vocab = oracle.SHAPES[shape]["vocab_size"]
    prompts = oracle.prompts(vocab, (7, 100, 700, 33, 250, 64, 400), seed=13)
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(7)]
    out, start_s = {}, {}
    for mode in ("eager", "padded", "graphs", "ahead"):
        t0 = time.perf_counter()
        engine = _engine(path, dtype=dtype, max_num_seqs=8, cuda_graphs=mode != "eager",
                         cuda_graphs_ahead=mode == "ahead")
        start_s[mode] = time.perf_counter() - t0
        if mode == "padded":
            engine.runner.graphs.record = False
        if mode == "ahead":
            ahead = dataclasses.replace(engine.runner.graphs.stats)
            buckets = len(engine.runner.graphs.all_buckets())
        out[mode] = [s.output_ids for s in engine.generate(prompts, params)]
        if mode == "graphs":
            stats = engine.runner.graphs.stats
        if mode == "ahead":
            served = engine.runner.graphs.stats
    ms = {}
    for graphs in (False, True):
        engine = _engine(path, dtype=dtype, max_num_seqs=8, cuda_graphs=graphs)
        ms[graphs] = [_decode_step_ms(engine, oracle.prompts(vocab, (512,) * b, seed=11), 24) for b in (1, 8)]
    parts = [_first_divergence(a, b) for a, b in zip(out["graphs"], out["eager"])]
    report(model=shape, dtype=dtype, recorded=stats.recorded, replays=stats.replays,
           identical_to_padded_eager=out["graphs"] == out["padded"], agree_with_eager_until=parts,
           ahead_recorded=ahead.recorded, ahead_identical=out["ahead"] == out["graphs"],
           start_s_lazy_ahead=f"{start_s['graphs']:.2f}->{start_s['ahead']:.2f}",
           step_ms_b1=f"{ms[False][0]:.2f}->{ms[True][0]:.2f}", step_ms_b8=f"{ms[False][1]:.2f}->{ms[True][1]:.2f}")
    # 31 decode steps through the buckets of 8, 4, 2 and 1 sequences: each bucket's first runs eagerly and records
    assert stats.padded == stats.recorded >= 4 and stats.replays + stats.padded == 31 and stats.eager == 0
    assert out["graphs"] == out["padded"]
    # recorded ahead: every bucket before the first request, none in service, every step a replay
    assert ahead.recorded == buckets and served.recorded == buckets and served.padded == 0
    assert served.replays == 31 and served.eager == 0
    assert out["ahead"] == out["graphs"]
    if dtype == "float32":  # eager fp32 decode equals transformers (test_greedy_fp32_equals_transformers_on_device)
        assert out["graphs"] == out["eager"]


def test_kernel_registry_on_device(report):
    report(attention=get_attention_kernels("cuda").name, kv=get_kv_kernels("cuda").name,
           device=torch.cuda.get_device_name(0))
    assert get_attention_kernels("cuda").name == "triton" and get_kv_kernels("cuda").name == "triton"
