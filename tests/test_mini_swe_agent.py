"""mini-swe-agent (2.4.6, its tool-calling `mini.yaml`) works a real task against the default `moorage up`
(issue 27): a small bug in a temporary git repository, four steps, each step's bash command executed.

The model's commands are arbitrary, so they run in bubblewrap as `nobody`, without network, with only the
task's repository writable (infra/dev-env.sh installs bubblewrap). SmolLM2-135M rarely calls a tool
unprompted: `tool_choice: required` goes through the agent's `model_kwargs`, as its docs allow; the call
is then valid by construction (the grammar), and the agent's own parser must accept every one.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from infra.up import UpConfig, launched
from shared.config import load_config

pytestmark = pytest.mark.slow
STEPS = 4
SANDBOX = ["--unshare-user", "--uid", "65534", "--gid", "65534", "--unshare-net", "--unshare-pid", "--new-session",
           "--die-with-parent", "--ro-bind", "/usr", "/usr", "--ro-bind", "/bin", "/bin", "--ro-bind", "/lib", "/lib",
           "--ro-bind", "/lib64", "/lib64", "--ro-bind", "/etc", "/etc", "--tmpfs", "/tmp", "--proc", "/proc",
           "--dev", "/dev", "--setenv", "PATH", "/usr/local/bin:/usr/sbin:/usr/bin:/bin", "--setenv", "HOME", "/tmp"]


def repo_with_a_bug(path) -> str:
    path.mkdir()
    (path / "greet.py").write_text('def greet(name):\n    return "Helo, " + name\n')
    (path / "test_greet.py").write_text('from greet import greet\n\nassert greet("World") == "Hello, World"\n')
    for cmd in (["git", "init", "-q"], ["git", "add", "."],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "start"]):
        subprocess.run(cmd, cwd=path, check=True)
    subprocess.run(["chmod", "-R", "a+rwX", str(path)], check=True)  # the sandbox's nobody works here
    return str(path)


def test_mini_swe_agent_runs_steps_of_a_real_task_with_its_commands_executed(tmp_path, monkeypatch):
    monkeypatch.setenv("MSWEA_CONFIGURED", "true")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no registry here: litellm's bundled copy
    from minisweagent import package_dir
    from minisweagent.agents.default import AgentConfig, DefaultAgent
    from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment
    from minisweagent.models.litellm_model import LitellmModel
    repo = repo_with_a_bug(tmp_path / "repo")
    config = yaml.safe_load((package_dir / "config" / "mini.yaml").read_text())
    agent_config = {k: v for k, v in config["agent"].items() if k in AgentConfig.model_fields}
    agent_config.update(step_limit=STEPS, cost_limit=0)
    cfg = load_config(UpConfig, overrides=["up.port=0", f"up.run_dir={tmp_path / 'run'}"], env={})
    with launched(cfg) as (_launcher, base):
        model = LitellmModel(model_name="openai/smollm2-135m", cost_tracking="ignore_errors",
                             observation_template=config["model"]["observation_template"],
                             format_error_template=config["model"]["format_error_template"],
                             model_kwargs={**config["model"].get("model_kwargs", {}), "api_base": base + "/v1",
                                           "api_key": "unused", "tool_choice": "required", "temperature": 0.0,
                                           "max_tokens": 96})
        env = BubblewrapEnvironment(cwd=repo, wrapper_args=SANDBOX, timeout=20)
        executed: list[tuple[str, dict]] = []
        run = env.execute

        def execute(action: dict, *args, **kwargs) -> dict:
            out = run(action, *args, **kwargs)
            executed.append((action.get("command", ""), out))
            return out

        env.execute = execute
        agent = DefaultAgent(model, env, **agent_config)
        agent.run('Fix greet() in greet.py so that `python3 test_greet.py` passes.')
    transcript = "\n".join(f"$ {cmd}\n{out.get('output', '')[:300]}" for cmd, out in executed)
    print(f"\nmini-swe-agent, {len(executed)} commands:\n{transcript}")
    assert len(executed) >= 3, [m.get("content") for m in agent.messages[-4:]]
    assert all(isinstance(cmd, str) and cmd.strip() for cmd, _ in executed)
    assert all(out["returncode"] != -1 or "timed out" in out.get("exception_info", "") for _, out in executed)
    assert sum(m.get("role") == "tool" for m in agent.messages) >= 3  # each call's output went back to the model
    assert os.path.exists(os.path.join(repo, "greet.py"))
