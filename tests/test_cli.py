"""`moorage generate` as a user runs it: a real subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_tiny_is_deterministic():
    a = run_cli("generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "8", "--show-tokens")
    b = run_cli("generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "8", "--show-tokens")
    assert a.returncode == 0, a.stderr
    assert "output_ids=" in a.stderr
    assert a.stdout == b.stdout and a.stderr == b.stderr


def test_generate_rejects_bad_arguments():
    r = run_cli("generate", "--model", "tiny", "--prompt", "x", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens" in r.stderr
    r = run_cli("generate", "--model", "no-such-model", "--prompt", "x")
    assert r.returncode == 2 and "smollm2-135m" in r.stderr


@pytest.mark.slow
def test_generate_chat_answers_paris():
    r = run_cli("generate", "--model", "smollm2-135m", "--chat", "--prompt", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
