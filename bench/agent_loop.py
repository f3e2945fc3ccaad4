"""An agent loop with a real agent framework (issue 27): mini-swe-agent against `moorage up`, pool on vs off.

    python -m bench.agent_loop [--quick] [--out PATH] [--steps N] [--sessions 1,2,4]

mini-swe-agent 2.4.6 with its tool-calling `mini.yaml` (as tests/test_mini_swe_agent.py drives it:
`tool_choice: required`, temperature 0, max_tokens 96 through model_kwargs; its bash commands run in
bubblewrap as `nobody`, without network). K = 1, 2, 4 agents run at once (threads), each on its own small
bug in its own temporary git repository (file names and bugs differ per agent and per K, so no two
sessions share a prompt beyond mini.yaml's system prompt and tools), N model calls ("steps") each. One
`moorage up` (default SmolLM2) per pool mode, `up.pool=true` then `up.pool=false`; the K runs follow one
another on the same system, after one throw-away warm-up request.

Every model call goes out streamed (stream_options.include_usage) and is rebuilt with
litellm.stream_chunk_builder, so the agent sees an ordinary response. Per step:
- first_token_s: the first SSE chunk (the router starts the response once the first token exists);
  ttft_s: the first chunk carrying content or a tool-call delta (with `tool_choice: required` the router
  sends a call once it is whole, so this is nearly the whole generation); latency_s: the last chunk;
- prompt_tokens, cached_tokens (usage.prompt_tokens_details) and usage.moorage {device, store, computed},
  from the raw SSE bytes (litellm drops the `moorage` key);
- the reuse ceiling: the longest common token prefix of this prompt and the previous step's prompt
  followed by its completion, over this prompt's tokens (0 at step 1). Prompt ids come from the router's
  own code (the exact request body through ChatCompletions.parse, render_prompt, the model's Tokenizer) and
  are checked against usage.prompt_tokens; the completion's ids are its assistant turn as the history renders
  it (ToolFormat.render_call), plus the end-of-turn token when the token count says the model stopped there;
- tool-call validity: a call to `bash` whose arguments parse as JSON and match the tool's schema
  (jsonschema), and the agent's own parser accepted it (no FormatError).

Summary per (pool mode, K): TTFT / first-token p50 and p90 at step 1 vs steps >= 2, cached share vs ceiling
from step 2 on (means and the gap in points), tool-call validity share, steps/s. The grammar's cost per
token is not measured here: bench/grammar.py's batch 1 / 8 rows are copied from bench/results/grammar.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench._util import machine_info, md_table, percentile, write_result

MODEL = "smollm2-135m"
# 1 GiB of KV (half each to the prefill's prefix cache and decode: ~11.6K SmolLM2 fp32 tokens each), so K = 4
# late steps outgrow the prefill's cache (the pool then has work); 2 x 512 MiB of store DRAM.
SYSTEM_SETS = ["up.port=0", "up.kv_memory=1GiB", "up.store_bytes=536870912"]
GRAMMAR_RESULT = Path(__file__).parent / "results" / "grammar.json"
POOL_MODES = (True, False)

# (function, buggy module, test line): each agent gets one, in files named after its run and index.
BUGS = [
    ("greet", 'def greet(name):\n    return "Helo, " + name\n', 'assert greet("World") == "Hello, World"'),
    ("add", "def add(a, b):\n    return a - b\n", "assert add(2, 3) == 5"),
    ("square", "def square(x):\n    return x * 2\n", "assert square(3) == 9"),
    ("shout", 'def shout(s):\n    return s.lower() + "!"\n', 'assert shout("hi") == "HI!"'),
    ("last", "def last(xs):\n    return xs[0]\n", "assert last([1, 2, 3]) == 3"),
    ("halve", "def halve(n):\n    return n * 2\n", "assert halve(8) == 4"),
]


@dataclass(frozen=True)
class Size:
    sessions: tuple[int, ...] = (1, 2, 4)
    steps: int = 6
    max_tokens: int = 96
    command_timeout_s: int = 20
    strict_tool: bool = False      # send the bash tool with additionalProperties: false (not mini.yaml's own)


QUICK = Size(sessions=(1, 2), steps=3)
FULL = Size()


def tools_for(strict: bool) -> list[dict]:
    """The bash tool the agent sends: mini-swe-agent's own, or (strict) the same with additionalProperties:
    false, so the grammar closes the object after `command`."""
    import copy

    from minisweagent.models.utils.actions_toolcall import BASH_TOOL

    tool = copy.deepcopy(BASH_TOOL)
    if strict:
        tool["function"]["parameters"]["additionalProperties"] = False
    return [tool]


def log(msg: str) -> None:
    print(f"[agent-loop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- pure logic (tests/test_agent_loop_bench.py) ---------------------------------------------------

def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def ceiling_tokens(prompt: list[int], prev_prompt: list[int] | None, prev_completion: list[int] | None) -> int:
    """The conversation's own reuse ceiling: how much of `prompt` the previous step's prompt and completion
    could have supplied (0 for a first step)."""
    if prev_prompt is None:
        return 0
    return common_prefix(prompt, list(prev_prompt) + list(prev_completion or ()))


def assistant_text(message: dict, fmt) -> str:
    """The assistant turn as moorage renders it into the next prompt (services/router/conversation.py
    _own_turns): content, then each call in the model's format."""
    content = message.get("content") or ""
    calls = [fmt.render_call(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or ()]
    return "\n".join(([content] if content else []) + calls)


def completion_ids(encode, text: str, completion_tokens: int, eos: int | None) -> tuple[list[int], bool]:
    """The completion's ids as the history renders it, and whether that accounts for every generated token
    (`completion_tokens`): the end-of-turn token is added when the count says the model stopped right there.
    Not exact when the model wrote more (a further call cut off by max_tokens, dropped by the router's
    parser) or spelled its JSON differently from the rendering."""
    ids = list(encode(text))
    if eos is not None and completion_tokens == len(ids) + 1:
        return ids + [eos], True
    return ids, completion_tokens == len(ids)


def call_validity(tool_calls: list[dict], tools: list[dict]) -> tuple[bool, str]:
    """(valid, why not): at least one call, each to a known tool, arguments a JSON object matching its schema."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    if not tool_calls:
        return False, "no tool call"
    for c in tool_calls:
        fn = c.get("function") or {}
        if fn.get("name") not in schemas:
            return False, f"unknown tool {fn.get('name')!r}"
        try:
            args = json.loads(fn.get("arguments") or "")
        except ValueError as e:
            return False, f"arguments are not JSON: {e}"
        try:
            jsonschema.validate(args, schemas[fn["name"]])
        except jsonschema.ValidationError as e:
            return False, f"arguments do not match the schema: {e.message}"
    return True, ""


def usage_from_sse(raw: bytes) -> dict | None:
    """The usage object of an OpenAI chat stream's last usage chunk, as sent (moorage's key included)."""
    usage = None
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            obj = json.loads(line[6:])
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("usage"):
            usage = obj["usage"]
    return usage


def _pct(xs: list[float], q: float) -> float | None:
    return round(percentile(xs, q), 3) if xs else None


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def summarize(rows: list[dict], wall_s: float) -> dict:
    """One (pool mode, K) run's steps: TTFT at step 1 vs later, cached share vs ceiling from step 2 on,
    tool-call validity, throughput."""
    first = [r for r in rows if r["step"] == 1 and r["ok"]]
    later = [r for r in rows if r["step"] >= 2 and r["ok"]]
    cached = [r["cached_tokens"] / r["prompt_tokens"] for r in later if r["prompt_tokens"]]
    ceiling = [r["ceiling_tokens"] / r["prompt_tokens"] for r in later if r["prompt_tokens"]]
    out = {"steps": len(rows), "ok_steps": sum(r["ok"] for r in rows),
           "sessions": len({r["session"] for r in rows}), "wall_s": round(wall_s, 2)}
    for key in ("first_token_s", "ttft_s", "latency_s"):
        name = key.removesuffix("_s")
        for label, sel in (("step1", first), ("later", later)):
            xs = [r[key] for r in sel if r.get(key) is not None]
            out[f"{name}_{label}_p50_s"] = _pct(xs, 50)
            out[f"{name}_{label}_p90_s"] = _pct(xs, 90)
    out["cached_share_later_mean"] = _mean(cached)
    out["ceiling_share_later_mean"] = _mean(ceiling)
    out["prompt_only_ceiling_share_later_mean"] = _mean([r["ceiling_prompt_only"] / r["prompt_tokens"] for r in later
                                                         if r["prompt_tokens"]])
    out["gap_points"] = (round(100 * (out["ceiling_share_later_mean"] - out["cached_share_later_mean"]), 2)
                         if cached else None)
    out["cached_share_step1_mean"] = _mean([r["cached_tokens"] / r["prompt_tokens"] for r in first
                                            if r["prompt_tokens"]])
    out["tool_call_valid_share"] = round(sum(r["tool_call_valid"] for r in rows) / len(rows), 4) if rows else None
    called = [r for r in rows if r.get("tool_calls")]
    out["finished_calls_valid_share"] = round(sum(r["tool_call_valid"] for r in called) / len(called), 4) \
        if called else None
    out["cut_off_share"] = round(sum(1 for r in rows if r["ok"] and not r.get("tool_calls")
                                     and r.get("finish_reason") == "length") / len(rows), 4) if rows else None
    out["steps_per_s"] = round(len(rows) / wall_s, 4) if wall_s > 0 else None
    out["prompt_tokens_mean"] = round(statistics.fmean([r["prompt_tokens"] for r in rows if r["ok"]]), 1) \
        if any(r["ok"] for r in rows) else None
    return out


def grammar_overhead(path: Path = GRAMMAR_RESULT) -> dict | None:
    """bench/grammar.py's batch 1 / 8 rows (not re-measured here), or None when it has not been run."""
    if not path.exists():
        return None
    g = json.loads(path.read_text())
    keep = ("batch", "steps", "repeats", "itl_free_ms", "itl_guided_ms", "overhead")
    root = Path(__file__).resolve().parent.parent
    return {"source": str(path.resolve().relative_to(root)) if path.resolve().is_relative_to(root) else str(path),
            "measured": (g.get("machine") or {}).get("date"),
            "note": "copied from bench/grammar.py's result, not measured by this benchmark; overhead = guided ITL "
                    "/ free ITL - 1 (in-process engine, decode only)",
            "rows": [{k: r[k] for k in keep if k in r} for r in g.get("rows", []) if r.get("batch") in (1, 8)]}


# --- the agents -----------------------------------------------------------------------------------

def make_repo(path: Path, bug: tuple[str, str, str], tag: str) -> tuple[str, str]:
    """A git repository with one bug; (its path, the task)."""
    fn, source, check = bug
    module = f"{fn}_{tag}"
    path.mkdir(parents=True)
    (path / f"{module}.py").write_text(source)
    (path / f"test_{module}.py").write_text(f"from {module} import {fn}\n\n{check}\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "."],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "start"]):
        subprocess.run(cmd, cwd=path, check=True)
    subprocess.run(["chmod", "-R", "a+rwX", str(path)], check=True)  # the sandbox's nobody works here
    return str(path), f"Fix {fn}() in {module}.py so that `python3 test_{module}.py` passes."


class Measure:
    """Renders a request's prompt ids with the router's own code (the request body as the router got it)."""

    def __init__(self, model: str):
        from services.router.api_openai import ChatCompletions
        from services.router.tool_calls import format_for
        from shared.engine.models import load_tokenizer

        self.tok, _ = load_tokenizer(model)
        self.fmt = format_for(getattr(self.tok, "chat_template", ""))
        self.api = ChatCompletions()
        eos = getattr(self.tok, "eos_token_ids", ()) or ()
        self.eos = eos[0] if eos else None

    def prompt_ids(self, body: bytes) -> list[int]:
        from services.router.conversation import render_prompt

        parsed = self.api.parse(body)
        return self.tok.encode(render_prompt(self.tok, parsed.conversation, self.fmt))


def _tee_client(base_url: str):
    """An openai client whose transport keeps the last request's body and the raw bytes of its response."""
    import httpx
    import openai

    class Tee(httpx.SyncByteStream):
        def __init__(self, inner, sink: list[bytes]):
            self.inner, self.sink = inner, sink

        def __iter__(self):
            for b in self.inner:
                self.sink.append(b)
                yield b

        def close(self) -> None:
            self.inner.close()

    class Transport(httpx.HTTPTransport):
        body: bytes = b""
        raw: list[bytes] = []

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            self.body, self.raw = request.read(), []
            response = super().handle_request(request)
            response.stream = Tee(response.stream, self.raw)
            return response

    transport = Transport()
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600,
                           http_client=httpx.Client(transport=transport, timeout=600))
    return client, transport


def timed_model_class():
    """LitellmModel whose calls stream (timed) and are rebuilt into one response, each call recorded."""
    import litellm
    from minisweagent.exceptions import FormatError
    from minisweagent.models.litellm_model import LitellmModel

    class TimedModel(LitellmModel):
        def __init__(self, *, base_url: str, on_step, tools: list[dict], **kwargs):
            super().__init__(**kwargs)
            self.client, self.transport = _tee_client(base_url)
            self.on_step, self.tools = on_step, tools
            self.last: dict = {}

        def _query(self, messages, **kwargs):
            params = self.config.model_kwargs | kwargs
            t0 = time.perf_counter()
            first = first_delta = None
            chunks = []
            self.last = {"error": "no response"}
            stream = litellm.completion(model=self.config.model_name, messages=messages, tools=self.tools,
                                        stream=True, stream_options={"include_usage": True}, client=self.client,
                                        **params)
            for chunk in stream:
                now = time.perf_counter()
                chunks.append(chunk)
                first = first if first is not None else now
                d = chunk.choices[0].delta if chunk.choices else None
                if first_delta is None and d is not None and (d.content or d.tool_calls):
                    first_delta = now
            end = time.perf_counter()
            response = litellm.stream_chunk_builder(chunks, messages=messages)
            self.last = {"t_start": t0, "first_token_s": None if first is None else first - t0,
                         "ttft_s": None if first_delta is None else first_delta - t0, "latency_s": end - t0,
                         "body": self.transport.body, "usage": usage_from_sse(b"".join(self.transport.raw)),
                         "response": response, "tools": self.tools}
            return response

        def query(self, messages, **kwargs) -> dict:
            try:
                message = super().query(messages, **kwargs)
            except FormatError as e:
                self.on_step(self.last, parsed=False, error=str(e.messages[0].get("content", ""))[:300])
                raise
            except Exception as e:
                self.on_step(self.last, parsed=False, error=f"{type(e).__name__}: {str(e)[:300]}", failed=True)
                raise
            self.on_step(self.last, parsed=True, error="")
            return message

    return TimedModel


@dataclass
class Session:
    """One agent's steps, turned into rows as they come."""
    mode: str
    k: int
    index: int
    measure: Measure
    rows: list[dict] = field(default_factory=list)
    prev_prompt: list[int] | None = None
    prev_completion: list[int] | None = None
    commands: list[dict] = field(default_factory=list)
    exit_status: str = ""
    error: str = ""

    def on_step(self, last: dict, parsed: bool, error: str, failed: bool = False) -> None:
        row = {"mode": self.mode, "k": self.k, "session": self.index, "step": len(self.rows) + 1,
               "ok": not failed and "response" in last, "parsed": parsed, "error": error}
        if row["ok"]:
            response = last["response"]
            message = response.choices[0].message.model_dump()
            usage = last["usage"] or response.usage.model_dump()
            ids = self.measure.prompt_ids(last["body"])
            completion_tokens = int(usage.get("completion_tokens") or 0)
            text = assistant_text(message, self.measure.fmt)
            comp, exact = completion_ids(self.measure.tok.encode, text, completion_tokens, self.measure.eos)
            ceiling = ceiling_tokens(ids, self.prev_prompt, self.prev_completion)
            calls = message.get("tool_calls") or []
            valid, why = call_validity(calls, last["tools"])
            row.update(
                t_start=last["t_start"],
                first_token_s=round(last["first_token_s"], 4) if last["first_token_s"] is not None else None,
                ttft_s=round(last["ttft_s"], 4) if last["ttft_s"] is not None else None,
                latency_s=round(last["latency_s"], 4),
                prompt_tokens=int(usage.get("prompt_tokens") or 0), rendered_prompt_tokens=len(ids),
                completion_tokens=completion_tokens, completion_ids_exact=exact,
                cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                moorage=usage.get("moorage"), ceiling_tokens=ceiling,
                ceiling_prompt_only=common_prefix(ids, self.prev_prompt) if self.prev_prompt else 0,
                finish_reason=response.choices[0].finish_reason, tool_calls=len(calls),
                schema_valid=valid, tool_call_valid=valid and parsed, invalid_reason=why or error,
                content=(message.get("content") or "")[:300],
                command=(json.loads(calls[0]["function"]["arguments"]).get("command", "") if valid else "")[:200])
            self.prev_prompt, self.prev_completion = ids, comp
        else:
            row.update(tool_call_valid=False, prompt_tokens=0, cached_tokens=0, ceiling_tokens=0, ceiling_prompt_only=0)
        self.rows.append(row)


def run_k(url: str, measure: Measure, mode: str, k: int, size: Size, work: Path) -> tuple[list[Session], float]:
    """K agents at once, each on its own bug; (their sessions, the wall time until the last one ended)."""
    import yaml
    from minisweagent import package_dir
    from minisweagent.agents.default import AgentConfig, DefaultAgent
    from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment

    from tests.test_mini_swe_agent import SANDBOX

    config = yaml.safe_load((package_dir / "config" / "mini.yaml").read_text())
    agent_config = {key: v for key, v in config["agent"].items() if key in AgentConfig.model_fields}
    agent_config.update(step_limit=size.steps, cost_limit=0)
    TimedModel = timed_model_class()
    sessions, threads = [], []
    barrier = threading.Barrier(k)

    def one(i: int, s: Session) -> None:
        repo, task = make_repo(work / f"{mode}-k{k}-{i}", BUGS[(k + i) % len(BUGS)], f"k{k}{chr(97 + i)}")
        model = TimedModel(base_url=url + "/v1", on_step=s.on_step, tools=tools_for(size.strict_tool),
                           model_name=f"openai/{MODEL}", cost_tracking="ignore_errors",
                           observation_template=config["model"]["observation_template"],
                           format_error_template=config["model"]["format_error_template"],
                           model_kwargs={**config["model"].get("model_kwargs", {}), "api_base": url + "/v1",
                                         "api_key": "unused", "tool_choice": "required",
                                         "temperature": 0.0, "max_tokens": size.max_tokens})
        env = BubblewrapEnvironment(cwd=repo, wrapper_args=SANDBOX, timeout=size.command_timeout_s)
        run = env.execute

        def execute(action: dict, *args, **kwargs) -> dict:
            out = run(action, *args, **kwargs)
            s.commands.append({"command": action.get("command", "")[:200], "returncode": out.get("returncode")})
            return out

        env.execute = execute
        agent = DefaultAgent(model, env, **agent_config)
        barrier.wait()
        try:
            s.exit_status = agent.run(task).get("exit_status", "")
        except Exception as e:  # recorded: the test and the report show it
            s.error = f"{type(e).__name__}: {str(e)[:300]}"

    for i in range(k):
        s = Session(mode, k, i, measure)
        sessions.append(s)
        threads.append(threading.Thread(target=one, args=(i, s), name=f"agent-{mode}-{k}-{i}"))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for s in sessions:
        for r in s.rows:
            r["t_start"] = round(r["t_start"] - t0, 3) if "t_start" in r else None
    return sessions, wall


def warm_up(url: str) -> float:
    """One throw-away call of about an agent's first prompt's size (its own system prompt, so nothing it
    leaves is a hit for the agents): a fresh system's first request pays one-time costs (the router's
    grammar setup, first prefill shapes) that belong to no step."""
    import random

    import litellm

    rng = random.Random(0)
    words = "file line test patch module error value token cache shell command output".split()
    text = " ".join(rng.choice(words) for _ in range(900))
    t0 = time.perf_counter()
    litellm.completion(model=f"openai/{MODEL}", api_base=url + "/v1", api_key="unused", tools=tools_for(False),
                       messages=[{"role": "system", "content": "Warm-up: " + text},
                                 {"role": "user", "content": "List files."}],
                       tool_choice="required", temperature=0.0, max_tokens=32)
    return time.perf_counter() - t0


def run_mode(pool: bool, size: Size, measure: Measure, work: Path, overrides: list[str]) -> dict:
    from infra.up import UpConfig, launched
    from shared.config import load_config

    mode = "pool_on" if pool else "pool_off"
    sets = [*SYSTEM_SETS, f"up.pool={'true' if pool else 'false'}", f"up.run_dir={work / ('run-' + mode)}",
            *overrides]
    cfg = load_config(UpConfig, overrides=sets, env={})
    runs = []
    t0 = time.perf_counter()
    with launched(cfg) as (_launcher, url):
        up_s = time.perf_counter() - t0
        warm = warm_up(url)
        log(f"{mode}: up in {up_s:.1f} s, warm-up call {warm:.1f} s")
        for k in size.sessions:
            sessions, wall = run_k(url, measure, mode, k, size, work)
            rows = [r for s in sessions for r in s.rows]
            summary = summarize(rows, wall)
            log(f"{mode} K={k}: {len(rows)} steps in {wall:.1f} s; cached {summary['cached_share_later_mean']} "
                f"vs ceiling {summary['ceiling_share_later_mean']}; valid {summary['tool_call_valid_share']}")
            runs.append({"k": k, "wall_s": round(wall, 2), "summary": summary, "rows": rows,
                         "sessions": [{"session": s.index, "steps": len(s.rows), "exit_status": s.exit_status,
                                       "error": s.error, "commands": s.commands} for s in sessions]})
    return {"mode": mode, "overrides": sets, "up_s": round(up_s, 2), "warm_up_s": round(warm, 2), "runs": runs}


def run(size: Size, overrides: list[str] = ()) -> dict:
    os.environ.setdefault("MSWEA_CONFIGURED", "true")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no registry here: litellm's bundled copy
    os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")  # an error is a result, not retried
    from shared.hashing import BLOCK_TOKENS

    measure = Measure(MODEL)
    with tempfile.TemporaryDirectory(prefix="agent-loop-") as tmp:
        modes = [run_mode(pool, size, measure, Path(tmp), list(overrides)) for pool in POOL_MODES]
    summary = [{"mode": m["mode"], "k": r["k"], **r["summary"]} for m in modes for r in m["runs"]]
    return {"params": {"quick": size == QUICK, "size": asdict(size), "model": MODEL, "block_tokens": BLOCK_TOKENS,
                       "agent": "mini-swe-agent 2.4.6, mini.yaml (tool calls), tool_choice required, temperature 0, "
                                f"max_tokens {size.max_tokens}, its bash tool"
                                + (" with additionalProperties: false" if size.strict_tool else " as it ships"),
                       "system": " ".join(SYSTEM_SETS + list(overrides)), "pool_modes": [m["mode"] for m in modes]},
            "summary": summary, "grammar_overhead": grammar_overhead(), "modes": modes}


# --- output ---------------------------------------------------------------------------------------

def report(result: dict) -> str:
    s = result["summary"]
    table = md_table(
        ["pool", "K", "steps", "first token p50/p90 s, step 1", "first token p50/p90 s, >=2",
         "TTFT (call delta) p50 s, 1 / >=2", "cached share >=2", "ceiling >=2 (prompt only)", "gap pts",
         "valid calls (of finished calls)", "cut off", "steps/s"],
        [[x["mode"], x["k"], x["steps"], f"{x['first_token_step1_p50_s']} / {x['first_token_step1_p90_s']}",
          f"{x['first_token_later_p50_s']} / {x['first_token_later_p90_s']}",
          f"{x['ttft_step1_p50_s']} / {x['ttft_later_p50_s']}", x["cached_share_later_mean"],
          f"{x['ceiling_share_later_mean']} ({x['prompt_only_ceiling_share_later_mean']})", x["gap_points"],
          f"{x['tool_call_valid_share']} ({x['finished_calls_valid_share']})", x["cut_off_share"],
          x["steps_per_s"]] for x in s])
    parts = [f"## mini-swe-agent loop vs moorage up ({'quick' if result['params']['quick'] else 'full'}: "
             f"{result['params']['size']['steps']} steps, K = {result['params']['size']['sessions']})\n", table]
    g = result.get("grammar_overhead")
    if g:
        parts.append("\ngrammar cost per token (from " + g["source"] + ", not measured here): " +
                     ", ".join(f"batch {r['batch']}: {r['overhead']:+.1%}" for r in g["rows"]))
    errors = [f"{m['mode']} K={r['k']} session {x['session']}: {x['error']}"
              for m in result["modes"] for r in m["runs"] for x in r["sessions"] if x["error"]]
    if errors:
        parts.append("\nerrors: " + "; ".join(errors))
    return "\n".join(parts)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = result["summary"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    fig.suptitle(f"mini-swe-agent loop vs moorage up (SmolLM2, {result['params']['size']['steps']} steps, "
                 f"{'quick' if result['params']['quick'] else 'full'}) - {result['machine']['date']}", fontsize=11)
    labels = [f"{x['mode']}\nK={x['k']}" for x in s]
    x = np.arange(len(s))

    ax = axes[0][0]
    ax.bar(x - 0.2, [v["first_token_step1_p50_s"] or 0 for v in s], 0.4, label="step 1")
    ax.bar(x + 0.2, [v["first_token_later_p50_s"] or 0 for v in s], 0.4, label="steps >= 2")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set(ylabel="time to first token, p50 (s)", title="First token (the router's first chunk)")
    ax.legend()

    ax = axes[0][1]
    ax.bar(x - 0.27, [v["ceiling_share_later_mean"] or 0 for v in s], 0.27, color="0.65",
           label="ceiling: previous prompt + completion")
    ax.bar(x, [v["prompt_only_ceiling_share_later_mean"] or 0 for v in s], 0.27, color="0.85",
           label="previous prompt only")
    bars = ax.bar(x + 0.27, [v["cached_share_later_mean"] or 0 for v in s], 0.27, label="cached (usage)")
    ax.bar_label(bars, labels=[f"-{v['gap_points']:.1f} pt" if v["gap_points"] is not None else "" for v in s],
                 fontsize=8)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylim(0, 1.25)
    ax.set(ylabel="share of prompt tokens, mean over steps >= 2", title="Cached vs the conversation's ceiling")
    ax.legend(fontsize=8, loc="upper left", ncol=2)

    ax = axes[1][0]
    for i, m in enumerate(result["modes"]):
        for j, r in enumerate(m["runs"]):
            rows = [row for row in r["rows"] if row["ok"]]
            ax.scatter([row["step"] + 0.08 * (j - 1) for row in rows], [row["first_token_s"] for row in rows],
                       s=14, color=f"C{i}", marker="os^v"[j % 4], label=f"{m['mode']} K={r['k']}")
    ax.set_xticks(range(1, result["params"]["size"]["steps"] + 1))
    ax.set(xlabel="step", ylabel="first token (s)", title="First token per step (every session)")
    ax.legend(fontsize=7)

    ax = axes[1][1]
    for i, m in enumerate(result["modes"]):
        ks = [r["k"] for r in m["runs"]]
        ax.plot(ks, [r["summary"]["steps_per_s"] for r in m["runs"]], "o-", color=f"C{i}", label=m["mode"])
    ax.set(xlabel="K (parallel agents)", ylabel="steps/s (model calls + commands)", title="Throughput")
    ax.set_xticks(sorted({r["k"] for m in result["modes"] for r in m["runs"]}))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="K = 1, 2 and 3 steps (unless given)")
    ap.add_argument("--out", default=None,
                    help="JSON result, PNG beside it (default runs/agent-loop-<time>/agent-loop.json)")
    ap.add_argument("--steps", type=int, default=None, help="model calls per agent")
    ap.add_argument("--sessions", default=None, help="parallel agents per run, e.g. 1,2,4")
    ap.add_argument("--strict-tool", action="store_true",
                    help="send the bash tool with additionalProperties: false (mini.yaml's own has none)")
    ap.add_argument("--set", action="append", default=[], help="moorage up override (repeatable)")
    args = ap.parse_args(argv)
    size = QUICK if args.quick else FULL
    if args.steps is not None or args.sessions is not None or args.strict_tool:
        size = dataclasses.replace(
            size, sessions=tuple(int(k) for k in args.sessions.split(",")) if args.sessions else size.sessions,
            steps=args.steps if args.steps is not None else size.steps, strict_tool=args.strict_tool)
    out = args.out or f"runs/agent-loop-{time.strftime('%Y%m%d-%H%M%S')}/agent-loop.json"
    t0 = time.perf_counter()
    result = {"machine": machine_info(), **run(size, args.set)}
    result["params"]["quick"] = args.quick
    write_result(result, out, t0, plot, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
