"""Decode attention on a GPU: the Triton paged kernel's memory bandwidth at 8K context, batch 32, against a
device-to-device copy of the same bytes (the ceiling it can approach) and the torch reference, in one run;
with --sweep, each kernel configuration (kernels.triton_attention.DecodeConfig) too, each checked against the
reference first.

    python -m bench.attention_device --out bench/results/attention-device.json [--sweep]

Bytes counted: every sequence's K and V over its context (all are read once) plus q and the output. Times:
CUDA events around 50 calls after 5 warm-ups, median of 5 such runs. Prints one line per case; ~20 s on an
H200 (about a minute with --sweep: each configuration compiles once per head shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

CASES = [("smollm2", 9, 3, 64), ("gqa-32/8/128", 32, 8, 128), ("gemma3-270m", 4, 1, 256)]


def cuda_seconds(fn, reps: int = 50, runs: int = 5) -> float:
    """Seconds per call of `fn`: CUDA events around `reps` calls after 5 warm-ups, the median of `runs`."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps / 1e3)
    return statistics.median(times)


SWEEP = [dict(tok=t, waves=w, num_warps=nw) for t in (64, 128) for w in (4, 8) for nw in (4, 8)]


def run(batch: int = 32, ctx: int = 8192, dtype=torch.bfloat16, sweep: bool = False) -> dict:
    from kernels import attention_reference, triton_attention

    results, configs = [], []
    for name, hq, hkv, d in CASES:
        blocks = batch * ctx // 16
        pages = torch.randn(blocks, 1, 2, 16, hkv, d, device="cuda").to(dtype)
        tables = torch.randperm(blocks, device="cuda").view(batch, ctx // 16)
        lens = torch.full((batch,), ctx, device="cuda")
        q = torch.randn(batch, hq, d, device="cuda").to(dtype)
        nbytes = pages.numel() * pages.element_size() + 2 * q.numel() * q.element_size()
        want = attention_reference.paged_decode(q, pages, 0, tables, lens, d ** -0.5)
        if sweep:
            default = triton_attention.CONFIG
            for fields in SWEEP:
                triton_attention.CONFIG = triton_attention.DecodeConfig(**fields)
                try:
                    err = float((triton_attention.paged_decode(q, pages, 0, tables, lens, d ** -0.5).float()
                                 - want.float()).abs().max())
                    t = cuda_seconds(lambda: triton_attention.paged_decode(q, pages, 0, tables, lens, d ** -0.5), runs=3)
                finally:
                    triton_attention.CONFIG = default
                nbytes_ = pages.numel() * pages.element_size()
                configs.append({"case": name, **fields, "max_err": err, "ms": t * 1e3, "gbs": nbytes_ / t / 1e9})
                print(f"  {name:14} {fields} {nbytes_ / t / 1e9:.0f} GB/s, max err {err:.1e}", flush=True)
        tri = cuda_seconds(lambda: triton_attention.paged_decode(q, pages, 0, tables, lens, d ** -0.5))
        ref = cuda_seconds(lambda: attention_reference.paged_decode(q, pages, 0, tables, lens, d ** -0.5), reps=5, runs=3)
        flat = pages.view(-1)
        dst = torch.empty_like(flat)
        copy = cuda_seconds(lambda: dst.copy_(flat))  # reads and writes: 2x the bytes
        row = {"case": name, "heads": f"{hq}/{hkv}", "head_dim": d, "batch": batch, "context": ctx,
               "dtype": str(dtype).split(".")[-1], "bytes_read": nbytes, "triton_ms": tri * 1e3,
               "reference_ms": ref * 1e3, "triton_gbs": nbytes / tri / 1e9, "copy_gbs": 2 * flat.numel() *
               flat.element_size() / copy / 1e9, "speedup_vs_reference": ref / tri}
        row["triton_over_copy"] = row["triton_gbs"] / row["copy_gbs"]
        results.append(row)
        print(f"{name:14} {row['triton_ms']:.3f} ms  {row['triton_gbs']:.0f} GB/s = {row['triton_over_copy']:.0%} of "
              f"a D2D copy ({row['copy_gbs']:.0f} GB/s); reference {row['reference_ms']:.2f} ms "
              f"({row['speedup_vs_reference']:.1f}x)", flush=True)
        del pages, dst, flat
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "config": dataclasses.asdict(triton_attention.CONFIG), "cases": results, "sweep": configs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/attention-device.json")
    ap.add_argument("--sweep", action="store_true", help="time every DecodeConfig of SWEEP too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.attention_device needs a CUDA device (torch sees none)", file=sys.stderr)
        return 2
    doc = run(sweep=args.sweep)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
