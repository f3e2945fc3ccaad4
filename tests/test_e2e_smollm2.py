"""The bundled model through the whole system: the router's greedy answer is exactly what
`moorage generate` prints, and a returning turn reuses its cached prefix and still matches."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from infra.up import UpConfig, launched
from tests.natsbus import nats_url

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.port=0", f"up.nats_url={url}", f"up.run_dir={tmp_path_factory.mktemp('up')}",
            "prefill.engine.num_blocks=256", "decode.engine.num_blocks=256"])
        with launched(cfg) as (_, base):
            yield base


def test_chat_equals_moorage_generate(base_url):
    question = "What is the capital of France?"
    cli = subprocess.run([sys.executable, "-m", "infra.cli", "generate", "--model", "smollm2-135m", "--chat",
                          "--prompt", question, "--max-tokens", "32"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    c = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": question}],
                                  max_tokens=32, temperature=0)
    assert r.choices[0].message.content == cli.stdout.rstrip("\n")
    assert "Paris" in r.choices[0].message.content


def test_returning_turn_hits_cache_and_matches_scratch(base_url, smollm2):
    c = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    history = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    first = c.chat.completions.create(model="smollm2-135m", messages=history, max_tokens=40, temperature=0,
                                      extra_headers={"X-Session-ID": "smol-1"})
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Now add a docstring."}]
    second = c.chat.completions.create(model="smollm2-135m", messages=history, max_tokens=40, temperature=0,
                                       extra_headers={"X-Session-ID": "smol-1"})
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    engine = Engine(smollm2, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    [ref] = engine.generate([smollm2.tokenizer.chat_token_ids(history)], SamplingParams(max_tokens=40))
    assert second.choices[0].message.content == ref.output_text
