"""`moorage bench aiperf`'s pure parts: the tokenizer directory and its fake Hugging Face cache entry, the
corpus AIPerf replays, the `aiperf profile` command line, and profile_export_aiperf.json -> summary rows.
Nothing here installs or runs AIPerf (that is `moorage bench aiperf --quick`, minutes, not a test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.aiperf import corpus, runner, summary, tokenizer
from bench.aiperf import main as aiperf_main

ZEROS = "0" * 40


# --- the tokenizer and the fake HF cache ---------------------------------------------------------

def _tiny_tokenizer_dir(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (path / "unrelated.bin").write_bytes(b"x")
    return path


def test_fake_hf_cache_layout(tmp_path):
    src = _tiny_tokenizer_dir(tmp_path / "tok")
    home = tmp_path / "hf"
    snap = tokenizer.register_fake_hf_cache(src, home, "local/smollm2-135m", stamp={"gguf": "x"})
    repo = home / "hub" / "models--local--smollm2-135m"
    assert snap == repo / "snapshots" / ZEROS
    assert (repo / "refs" / "main").read_text() == ZEROS  # exactly the commit, no newline
    assert sorted(p.name for p in snap.iterdir()) == ["chat_template.jinja", tokenizer.STAMP, "tokenizer.json",
                                                      "tokenizer_config.json"]
    # registering again replaces the snapshot (no stale files survive)
    (snap / "stale.json").write_text("{}")
    tokenizer.register_fake_hf_cache(src, home, "local/smollm2-135m")
    assert not (snap / "stale.json").exists() and (snap / "tokenizer.json").exists()
    with pytest.raises(FileNotFoundError):
        tokenizer.register_fake_hf_cache(tmp_path, home)  # no tokenizer.json there
    env = tokenizer.offline_env(home)
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1" and env["HF_HOME"] == str(home)


def test_fake_cache_resolves_offline_by_repo_id(tmp_path):
    """What AIPerf's workers do: snapshot_download(repo id) with HF_HUB_OFFLINE=1 finds the entry, no network."""
    pytest.importorskip("huggingface_hub")
    home = tmp_path / "hf"
    snap = tokenizer.register_fake_hf_cache(_tiny_tokenizer_dir(tmp_path / "tok"), home)
    code = ("from huggingface_hub import snapshot_download; "
            f"print(snapshot_download({tokenizer.REPO_ID!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**tokenizer.offline_env(home), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(snap)


def test_tokenizer_from_the_bundled_gguf_matches_moorage(tmp_path):
    """The converter (transformers' convert_gguf_tokenizer over gguf metadata, no torch needed) builds a
    tokenizer that splits text exactly as moorage's own, with SmolLM2's chat template beside it."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from shared.engine.models import load_tokenizer, smollm2_gguf_path

    out = tmp_path / "tok"
    info = tokenizer.build_tokenizer_dir(smollm2_gguf_path(), out, sys.executable)
    assert info["architecture"] == "llama" and info["vocab"] == 49152 and info["chat_template"]
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["model_max_length"] == 8192
    assert cfg["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()
    hf = Tokenizer.from_file(str(out / "tokenizer.json"))
    ours, _ = load_tokenizer("smollm2-135m")
    for text in ("def f(x):\n    return x ** 2  # 12345", "<|im_start|>user\nhi<|im_end|>", " naïve  café\t中文"):
        assert hf.encode(text).ids == ours.encode(text)
    # registered, then reused while the GGUF is unchanged
    home = tmp_path / "hf"
    snap = tokenizer.register_fake_hf_cache(out, home, stamp=tokenizer._source_stamp(smollm2_gguf_path()) | {
        "repo_id": tokenizer.REPO_ID})
    assert tokenizer.ensure_tokenizer(home, smollm2_gguf_path(), python="/nonexistent/python") == snap


# --- the corpus and the command line -------------------------------------------------------------

# AIPerf 0.13's weka models forbid extra keys (pydantic extra="forbid"): what our traces may carry
WEKA_TRACE_KEYS = {"id", "models", "block_size", "hash_id_scope", "tool_tokens", "system_tokens", "requests", "totals"}
WEKA_REQUEST_KEYS = {"t", "type", "model", "in", "out", "hash_ids", "input_types", "output_types", "stop",
                     "api_time", "think_time", "ttft"}
WEKA_SUBAGENT_KEYS = {"t", "type", "agent_id", "subagent_type", "duration_ms", "total_tokens", "tool_use_count",
                      "status", "requests", "models", "tool_tokens", "system_tokens"}


def test_quick_corpus_is_weka_shaped_small_and_has_subagents(tmp_path, capsys):
    params = corpus.synth_params(quick=True, seed=3, overrides=["sessions=3"])
    assert params["sessions"] == 3 and params["seed"] == 3 and params["model"] == "smollm2-135m"
    made_by = corpus.write_corpus(params, tmp_path / "traces")
    assert made_by.startswith("moorage trace synth --out ") and "--fanout-prob 0.5" in made_by
    info, sessions = corpus.describe(tmp_path / "traces")
    assert info["sessions"] == 3 == len(sessions) and info["subagent_requests"] >= 1
    assert info["max_input_tokens"] < 7168 and 0 < info["ceiling"] < 1
    for f in (tmp_path / "traces").glob("*.json"):
        trace = json.loads(f.read_text())
        assert set(trace) <= WEKA_TRACE_KEYS and trace["hash_id_scope"] == "local"
        for item in trace["requests"]:
            if item["type"] == "subagent":
                assert set(item) <= WEKA_SUBAGENT_KEYS and "models" in item
                assert all(set(r) <= WEKA_REQUEST_KEYS and r["type"] in ("n", "s") for r in item["requests"])
            else:
                assert set(item) <= WEKA_REQUEST_KEYS
    with pytest.raises(ValueError, match="KEY=VALUE"):
        corpus.synth_params(quick=False, overrides=["no_such_knob=1"])
    assert corpus.synth_params(quick=False, overrides=["shared-prefix=false"])["shared_prefix"] is False


def test_aiperf_command_and_environment(tmp_path):
    r = runner.AiperfRun(url="http://127.0.0.1:9", traces="/t", concurrency=2, request_count=17, sessions=3,
                         out_dir=str(tmp_path / "a"), seed=5, think_cap_s=2.0, extra_args=["--workers-max", "2"])
    cmd = runner.command("/v/bin/aiperf", r)
    joined = " ".join(cmd)
    assert cmd[:2] == ["/v/bin/aiperf", "profile"]
    for part in ("--tokenizer local/smollm2-135m", "--endpoint-type chat --streaming",
                 "--input-file /t --custom-dataset-type weka_trace", "--concurrency 2 --request-count 17 --num-sessions 3",
                 "--use-server-token-count", "--extra-inputs ignore_eos:true", "--random-seed 5",
                 "--inter-turn-delay-cap-seconds 2", "--ui none", f"--output-artifact-dir {tmp_path / 'a'}"):
        assert part in joined, part
    assert cmd[-2:] == ["--workers-max", "2"]
    r.think_cap_s = None
    assert "--inter-turn-delay-cap-seconds" not in runner.command("aiperf", r)
    env = runner.environment(tmp_path / "hf", base={"PATH": "/bin", "VIRTUAL_ENV": "/x"})
    assert env["AIPERF_HTTP_X_SESSION_ID_FROM_CORRELATION_ID"] == "true" and env["HF_HUB_OFFLINE"] == "1"
    assert "VIRTUAL_ENV" not in env and env["PATH"] == "/bin"


def test_concurrency_above_the_sessions_fails_before_installing(tmp_path, capsys):
    code = aiperf_main.main(["--quick", "--concurrency", "1,4", "--work-dir", str(tmp_path / "w"),
                             "--venv", str(tmp_path / "no-venv")])
    assert code == 2 and "concurrency 4 > 2 sessions" in capsys.readouterr().err
    assert not (tmp_path / "no-venv").exists()
    assert aiperf_main.main(["--quick", "--pools", "on,maybe", "--work-dir", str(tmp_path / "w2")]) == 2


def test_store_bytes_follow_the_corpus():
    from bench.agentic.trace import TraceRequest, TraceSession

    ids = list(range(1, 1001))  # 1000 blocks of 64 tokens, twice (the second request repeats them)
    reqs = [TraceRequest(t=float(i), type="s", model="m", in_tokens=64_000, out_tokens=1, hash_ids=ids)
            for i in range(2)]
    s = TraceSession(id="s", models=["m"], block_size=64, hash_id_scope="local", requests=reqs)
    assert aiperf_main._store_bytes([s], stores=1) == -(-int(1.5 * 64_000 * aiperf_main.KV_BYTES_PER_TOKEN)
                                                       // (1 << 20)) << 20
    assert aiperf_main._store_bytes([], stores=1) == 256 << 20


# --- profile_export_aiperf.json -> rows ----------------------------------------------------------

def _pcts(p50, p90, p99, unit="ms"):
    return {"unit": unit, "avg": p50, "p50": p50, "p90": p90, "p99": p99, "min": p50, "max": p99, "count": 9}


# A hand-written sample with AIPerf 0.13's field names (see bench/aiperf/summary.py)
SAMPLE = {
    "schema_version": "1.4", "aiperf_version": "0.13.0", "is_complete": True, "was_cancelled": False,
    "request_count": {"unit": "requests", "avg": 9.0},
    "error_request_count": {"unit": "requests", "avg": 3.0},
    "error_summary": [
        {"error_details": {"code": 429, "type": "Too Many Requests", "message": "gate: no KV budget"}, "count": 2},
        {"error_details": {"code": None, "type": "ReadTimeout", "message": "timed out"}, "count": 1},
    ],
    "time_to_first_token": _pcts(1200.0, 3400.0, 5600.0),
    "inter_token_latency": _pcts(85.0, 120.0, 300.0),
    "request_latency": _pcts(2500.0, 4000.0, 7000.0),
    "overall_usage_prompt_cache_read_pct": {"unit": "%", "avg": 61.5},
    "theoretical_prefix_cache_hit": {"unit": "%", "avg": 72.25, "count": 198, "sum": 143},
    "request_throughput": {"unit": "requests/sec", "avg": 0.25},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 3.5},
    "total_usage_prompt_tokens": {"unit": "tokens", "avg": 12400.0},
    "total_usage_prompt_cache_read_tokens": {"unit": "tokens", "avg": 7626.0},
    "benchmark_duration": {"unit": "sec", "avg": 36.0},
}


def test_summarize_export_sample():
    s = summary.summarize_export(SAMPLE)
    assert (s["ok"], s["errors"], s["rejected"]) == (9, 3, 2)
    assert s["error_statuses"] == {"429": 2, "ReadTimeout": 1}  # the HTTP code, else the error type
    assert s["cache_read"] == pytest.approx(0.615) and s["ceiling"] == pytest.approx(0.7225)
    assert s["ttft_s"] == pytest.approx({"p50": 1.2, "p90": 3.4, "p99": 5.6})
    assert s["itl_ms"]["p50"] == 85.0 and s["requests_per_s"] == 0.25 and s["duration_s"] == 36.0
    assert "gate: no KV budget" in s["error_messages"]


def test_summarize_export_without_errors_or_data():
    clean = {k: v for k, v in SAMPLE.items() if k not in ("error_request_count", "error_summary")}
    s = summary.summarize_export(clean)
    assert (s["errors"], s["rejected"], s["error_statuses"]) == (0, 0, {})
    empty = summary.summarize_export({"request_count": {"avg": 0}})
    assert empty["ttft_s"]["p50"] is None and empty["cache_read"] is None and empty["ok"] == 0


def test_table_pairs_pool_on_and_off_and_plots(tmp_path):
    off = json.loads(json.dumps(SAMPLE))
    off["overall_usage_prompt_cache_read_pct"]["avg"] = 40.0
    del off["error_request_count"], off["error_summary"]
    runs = [{"pool": "off", "concurrency": 2, "summary": summary.summarize_export(off)},
            {"pool": "on", "concurrency": 1, "summary": summary.summarize_export(SAMPLE)},
            {"pool": "off", "concurrency": 1, "error": "aiperf exit 1"},
            {"pool": "on", "concurrency": 2, "summary": summary.summarize_export(SAMPLE)}]
    lines = summary.table(runs).splitlines()
    assert lines[0].startswith("| pool | conc | ok | errors (rejected) | error statuses | cache read / ceiling")
    body = [ln.split(" | ") for ln in lines[2:]]
    assert [(b[0], b[1]) for b in body] == [("| on", "1"), ("| off", "1"), ("| on", "2"), ("| off", "2")]
    assert body[0][3] == "3 (2)" and body[0][4] == "429 x2, ReadTimeout x1" and body[0][5] == "61.5% / 72.2%"
    assert body[0][6:9] == ["1.2", "3.4", "5.6"] and body[0][9] == "85"
    assert "failed: aiperf exit 1" in lines[3]
    assert body[3][5] == "40.0% / 72.2%" and body[3][3] == "0 (0)"
    png = tmp_path / "a.png"
    summary.plot(runs, png, "test")
    assert png.stat().st_size > 10_000
