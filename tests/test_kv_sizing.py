"""KV sized from memory: parsing, the block arithmetic, the engine using it, and `moorage up`'s split."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import ConfigError, load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv_sizing import AUTO_SHARE, MemorySpec, parse_memory, size_kv
from shared.engine.models import load_model
from infra.kv_split import ENGINE_DEVICE_BYTES, ENGINE_PROCESS_BYTES, device_free_bytes, engine_device, split_kv
from infra.up import UpConfig, plan

GiB = 1 << 30


@pytest.mark.parametrize("spec, expect", [
    ("40%", MemorySpec(share=0.4)), ("100%", MemorySpec(share=1.0)), ("auto", MemorySpec(share=AUTO_SHARE)),
    ("6GiB", MemorySpec(bytes=6 * GiB)), ("1.5GB", MemorySpec(bytes=1_500_000_000)),
    ("512 MiB", MemorySpec(bytes=512 << 20)), ("4096", MemorySpec(bytes=4096)), (8192, MemorySpec(bytes=8192)),
])
def test_parse_memory(spec, expect):
    assert parse_memory(spec) == expect


@pytest.mark.parametrize("bad", ["0%", "120%", "-3GiB", "lots", "6 parsecs", "", 0, True])
def test_parse_memory_rejects(bad):
    with pytest.raises(ValueError):
        parse_memory(bad)


def test_size_kv_from_a_share_of_available_memory():
    s = size_kv(0, "50%", block_bytes=1 << 20, device="cpu", available=10 * GiB)
    assert s.num_blocks == 5 * 1024 and s.bytes == 5 * GiB and "50%" in s.how
    assert size_kv(0, "3GiB", 1 << 20, "cpu").num_blocks == 3072
    assert size_kv(77, "50%", 1 << 20, "cpu", available=1).num_blocks == 77  # an explicit count wins
    with pytest.raises(ValueError, match="less than one KV block"):
        size_kv(0, "1KiB", 1 << 20, "cpu")


def test_engine_sizes_its_pages_from_kv_memory():
    tiny = load_model("tiny")
    probe = Engine(tiny, EngineConfig(num_blocks=1))
    block_bytes = probe.layout.block_size * probe.layout.bytes_per_token
    e = Engine(tiny, EngineConfig(kv_memory=str(100 * block_bytes + 5)))
    assert e.config.num_blocks == 100 and e.block_manager.num_blocks == 100
    assert e.kv_capacity_tokens == 100 * e.layout.block_size
    assert e.pages[0].shape[0] == 100


def up_config(*overrides: str) -> UpConfig:
    return load_config(UpConfig, overrides=list(overrides), env={})


def test_up_splits_the_host_between_decode_and_prefill():
    cfg = up_config()
    kv = split_kv(cfg.up, 24 * GiB)
    stores = 2 * GiB
    assert kv.reserved >= stores + 2 * ENGINE_PROCESS_BYTES
    assert kv.decode_bytes == kv.prefill_bytes == int((24 * GiB - kv.reserved) * 0.6 * 0.5)
    t = {inst: c for inst, _, c in plan(cfg, "nats://127.0.0.1:1", Path("/tmp/x"), kv)}
    assert t["decode-0"].engine.kv_memory == str(kv.decode_bytes)
    assert t["prefill-0"].engine.kv_memory == str(kv.prefill_bytes)
    # a 24 GiB host gives decode far more than the 16K tokens that made agents wait (46,080 B/token fp32)
    assert kv.decode_bytes // 46_080 > 64_000


def test_up_split_over_instances_and_shares():
    cfg = up_config("up.groups=2", "up.prefills=2", "up.decode_kv_share=0.25", "up.kv_memory=16GiB")
    kv = split_kv(cfg.up, 64 * GiB)
    assert kv.decode_bytes == 16 * GiB // 4 // 2 and kv.prefill_bytes == 16 * GiB * 3 // 4 // 4


def test_up_leaves_explicit_engine_sizes_alone():
    cfg = up_config("prefill.engine.num_blocks=80", "decode.engine.kv_memory=2GiB")
    t = {inst: c for inst, _, c in plan(cfg, "nats://127.0.0.1:1", Path("/tmp/x"), split_kv(cfg.up, 24 * GiB))}
    assert t["prefill-0"].engine.num_blocks == 80 and t["prefill-0"].engine.kv_memory == "auto"
    assert t["decode-0"].engine.kv_memory == "2GiB"


def test_up_on_a_busy_host_starts_smaller_and_says_clearly_when_it_cannot():
    kv = split_kv(up_config().up, 4 * GiB)  # less than the allowance for stores and processes
    assert kv.decode_bytes == kv.prefill_bytes == int(GiB * 0.6 * 0.5)
    with pytest.raises(ConfigError, match="too little memory for KV"):
        split_kv(up_config().up, 256 << 20)
    with pytest.raises(ConfigError, match="up.kv_memory"):
        up_config("up.kv_memory=plenty")


def test_up_splits_an_accelerator_among_its_engines_not_the_host():
    """engine.device=cuda: the engines' KV comes out of the device's free memory, less each engine's weights,
    context and activations; the stores' segments (host memory) are not subtracted from it."""
    cfg = up_config("prefill.engine.device=cuda", "decode.engine.device=cuda", f"up.store_bytes={8 * GiB}")
    assert engine_device(cfg) == "cuda"
    kv = split_kv(cfg.up, 140 * GiB, "cuda")
    assert kv.reserved == 2 * ENGINE_DEVICE_BYTES
    assert kv.decode_bytes == kv.prefill_bytes == int((140 * GiB - 2 * ENGINE_DEVICE_BYTES) * 0.6 * 0.5)
    host = split_kv(cfg.up, 140 * GiB)
    assert host.reserved > 8 * GiB > kv.reserved


def test_up_refuses_one_kv_split_over_two_devices():
    cfg = up_config("prefill.engine.device=cuda", "decode.engine.device=cpu")
    with pytest.raises(ConfigError, match="different devices"):
        engine_device(cfg)


def test_device_free_memory_failure_is_a_config_error():
    """A device this torch cannot use (a CPU build asked for cuda) fails `moorage up` with the reason."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device: the failure path needs one without")  # not counted: gpu hosts only
    with pytest.raises(ConfigError, match="cannot read its free memory"):
        device_free_bytes("cuda")
