"""shared/config.py: precedence, coercion, errors that name the key, nested sections, describe(), the
TOML writer's round trip, and the service CLI (`--set`, `--print-config`) as a real subprocess."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infra.tomlgen import to_toml
from infra.up import UpConfig
from services.decode.config import DecodeConfig
from services.gate.config import GateConfig, GateSettings
from services.prefill.config import PrefillConfig
from services.router.config import RouterConfig
from shared.config import ConfigError, describe, load_config, parse_overrides

REPO = Path(__file__).resolve().parents[1]


# ---- a small config with every kind of field -------------------------------------------------------
@dataclass
class Inner:
    name: str = "x"
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    tags: list[str] = field(default_factory=list)
    nums: list[int] = field(default_factory=list)
    pair: tuple[int, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)
    maybe: str | None = "set"
    maybe_int: int | None = None


@dataclass
class Sample:
    top: str = "t"
    inner: Inner = field(default_factory=Inner)
    other: Inner = field(default_factory=Inner)


@pytest.fixture
def toml_file(tmp_path):
    def write(text: str) -> Path:
        path = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}.toml"
        path.write_text(text)
        return path

    return write


def test_defaults_without_any_source():
    assert load_config(Sample, env={}) == Sample()
    assert load_config(GateConfig, env={}) == GateConfig()


def test_precedence_defaults_file_env_overrides(toml_file):
    path = toml_file('top = "file"\n[inner]\nname = "file"\ncount = 2\nratio = 0.25\n')
    env = {"MOORAGE__INNER__NAME": "env", "MOORAGE__INNER__COUNT": "3", "UNRELATED": "1"}
    cfg = load_config(Sample, path, ["inner.name=cli"], env=env)
    assert cfg.inner.name == "cli"       # overrides beat env
    assert cfg.inner.count == 3          # env beats file
    assert cfg.inner.ratio == 0.25       # file beats defaults
    assert cfg.top == "file"
    assert cfg.inner.flag is False       # untouched default
    assert cfg.other == Inner()          # a sibling section stays at its defaults


def test_env_names_are_case_insensitive_and_need_the_prefix():
    cfg = load_config(Sample, env={"moorage__Inner__Count": "9", "MOORAGE_INNER__COUNT": "5", "INNER__COUNT": "6"})
    assert cfg.inner.count == 9


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("MOORAGE__INNER__COUNT", "11")
    assert load_config(Sample).inner.count == 11


def test_later_overrides_win():
    cfg = load_config(Sample, overrides=["inner.count=1", "inner.count=2", "top=a=b"], env={})
    assert cfg.inner.count == 2
    assert cfg.top == "a=b"  # only the first '=' separates key from value


@pytest.mark.parametrize("setting, attr, expected", [
    ("inner.count=42", "count", 42),
    ("inner.count= 7 ", "count", 7),
    ("inner.ratio=3", "ratio", 3.0),
    ("inner.ratio=1e-3", "ratio", 0.001),
    ("inner.flag=true", "flag", True),
    ("inner.flag=YES", "flag", True),
    ("inner.flag=on", "flag", True),
    ("inner.flag=1", "flag", True),
    ("inner.flag=false", "flag", False),
    ("inner.flag=0", "flag", False),
    ("inner.flag=off", "flag", False),
    ("inner.name=hello world", "name", "hello world"),
    ("inner.name=", "name", ""),
    ("inner.tags=a,b", "tags", ["a", "b"]),
    ("inner.tags= a , b ,", "tags", ["a", "b"]),
    ('inner.tags=["a", "b,c"]', "tags", ["a", "b,c"]),
    ("inner.tags=[]", "tags", []),
    ("inner.nums=1,2,3", "nums", [1, 2, 3]),
    ("inner.nums=[4, 5]", "nums", [4, 5]),
    ("inner.pair=1,2", "pair", (1, 2)),
    ('inner.extra={"k": "v", "a": "b"}', "extra", {"k": "v", "a": "b"}),
    ("inner.maybe=none", "maybe", None),
    ("inner.maybe=null", "maybe", None),
    ("inner.maybe=", "maybe", None),
    ("inner.maybe=text", "maybe", "text"),
    ("inner.maybe_int=5", "maybe_int", 5),
    ("inner.maybe_int=None", "maybe_int", None),
])
def test_string_coercion(setting, attr, expected):
    value = getattr(load_config(Sample, overrides=[setting], env={}).inner, attr)
    assert value == expected and type(value) is type(expected)


def test_toml_native_types(toml_file):
    path = toml_file('[inner]\nname = 5\ncount = 4.0\nratio = 2\nflag = true\ntags = ["p", "q"]\n'
                     'nums = [1, 2]\npair = [3, 4]\nextra = {k = "v"}\nmaybe_int = 8\n')
    inner = load_config(Sample, path, env={}).inner
    assert inner == Inner(name="5", count=4, ratio=2.0, flag=True, tags=["p", "q"], nums=[1, 2], pair=(3, 4),
                          extra={"k": "v"}, maybe_int=8)
    assert type(inner.count) is int and type(inner.ratio) is float


@pytest.mark.parametrize("setting, key", [
    ("inner.flag=maybe", "inner.flag"),
    ("inner.count=many", "inner.count"),
    ("inner.count=1.5", "inner.count"),
    ("inner.ratio=fast", "inner.ratio"),
    ("inner.nums=1,x", "inner.nums[1]"),
    ("inner.extra=k=v", "inner.extra"),
    ("inner.extra=[1]", "inner.extra"),
    ("inner.maybe_int=abc", "inner.maybe_int"),
    ("inner.count.deeper=1", "inner.count"),
])
def test_bad_values_name_the_key(setting, key):
    with pytest.raises(ConfigError) as e:
        load_config(Sample, overrides=[setting], env={})
    assert key in str(e.value)


@pytest.mark.parametrize("text, key", [
    ("[inner]\nflag = 1\n", "inner.flag"),          # TOML int is not a bool
    ("[inner]\ncount = true\n", "inner.count"),     # nor a bool an int
    ("[inner]\ncount = 1.5\n", "inner.count"),      # no silent truncation
    ("[inner]\nratio = false\n", "inner.ratio"),
    ('[inner]\nname = ["a"]\n', "inner.name"),
    ("[inner]\ntags = 3\n", "inner.tags"),
    ("[inner]\nextra = 3\n", "inner.extra"),
])
def test_bad_toml_types_name_the_key(toml_file, text, key):
    with pytest.raises(ConfigError) as e:
        load_config(Sample, toml_file(text), env={})
    assert key in str(e.value)


def test_bad_env_value_names_the_key():
    with pytest.raises(ConfigError, match="inner.flag"):
        load_config(Sample, env={"MOORAGE__INNER__FLAG": "perhaps"})


def test_unknown_key_lists_known_keys(toml_file):
    with pytest.raises(ConfigError) as e:
        load_config(Sample, overrides=["inner.nmae=x"], env={})
    msg = str(e.value)
    assert "inner.nmae" in msg
    for known in ("name", "count", "ratio", "flag", "tags", "extra", "maybe"):
        assert known in msg
    # the same from the environment and from a file
    with pytest.raises(ConfigError, match="inner.nope.*name, count"):
        load_config(Sample, env={"MOORAGE__INNER__NOPE": "1"})
    with pytest.raises(ConfigError, match="inner.nope.*name, count"):
        load_config(Sample, toml_file("[inner]\nnope = 1\n"), env={})


def test_unknown_section_lists_known_sections(toml_file):
    with pytest.raises(ConfigError) as e:
        load_config(Sample, overrides=["inenr.name=x"], env={})
    assert "inenr" in str(e.value)
    assert all(k in str(e.value) for k in ("top", "inner", "other"))
    with pytest.raises(ConfigError, match="busy"):
        load_config(GateConfig, env={"MOORAGE__BUSY__URL": "nats://x:1"})
    with pytest.raises(ConfigError, match="gaet"):
        load_config(GateConfig, toml_file("[gaet]\nretry_after_s = 1\n"), env={})


def test_section_set_to_a_scalar(toml_file):
    with pytest.raises(ConfigError, match="inner.*section"):
        load_config(Sample, overrides=["inner=3"], env={})
    with pytest.raises(ConfigError, match="bus.*section"):
        load_config(GateConfig, env={"MOORAGE__BUS": "nats://x:1"})
    with pytest.raises(ConfigError, match="inner.*section"):
        load_config(Sample, toml_file("inner = 3\n"), env={})


def test_malformed_toml(toml_file, tmp_path):
    bad = toml_file("[inner\nname = \n")
    with pytest.raises(ConfigError, match=re.escape(str(bad))):
        load_config(Sample, bad, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(Sample, tmp_path / "missing.toml", env={})


@pytest.mark.parametrize("item", ["inner.count", "=3", " =3", ""])
def test_set_without_key_value(item):
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides([item])
    with pytest.raises(ConfigError):
        load_config(Sample, overrides=[item], env={})


def test_validation_errors_surface_as_config_errors():
    with pytest.raises(ConfigError, match="budget_fraction"):
        load_config(GateConfig, overrides=["gate.budget_fraction=1.5"], env={})
    with pytest.raises(ConfigError, match="routing"):
        load_config(RouterConfig, overrides=["router.routing=random"], env={})


def test_real_service_configs_accept_their_keys():
    cfg = load_config(GateConfig, overrides=["bus.url=nats://h:1", "gate.admission_wait_s=2", "log.json=false"],
                      env={"MOORAGE__TRACING__HEADERS": '{"Authorization": "Bearer x"}'})
    assert cfg.bus.url == "nats://h:1" and cfg.gate.admission_wait_s == 2.0 and cfg.log.json is False
    assert cfg.tracing.headers == {"Authorization": "Bearer x"}
    r = load_config(RouterConfig, overrides=["router.api_keys=k1,k2", "router.port=0"], env={})
    assert r.router.api_keys == ["k1", "k2"] and r.router.port == 0
    p = load_config(PrefillConfig, overrides=["engine.kv_dtype=bfloat16", "transfer.slots=3"], env={})
    assert p.engine.kv_dtype == "bfloat16" and p.transfer.slots == 3
    assert load_config(PrefillConfig, overrides=["engine.kv_dtype=none"], env={}).engine.kv_dtype is None


def test_three_level_keys_for_up_config(toml_file):
    cfg = load_config(UpConfig, overrides=["prefill.engine.num_blocks=7", "up.port=9",
                                           "router.router.port=8081"], env={})
    assert cfg.prefill.engine.num_blocks == 7 and cfg.up.port == 9 and cfg.router.router.port == 8081
    assert cfg.decode.engine.num_blocks == DecodeConfig().engine.num_blocks  # a sibling untouched
    env = {"MOORAGE__DECODE__ENGINE__NUM_BLOCKS": "5", "MOORAGE__GATE__GATE__RETRY_AFTER_S": "2.5"}
    cfg = load_config(UpConfig, env=env)
    assert cfg.decode.engine.num_blocks == 5 and cfg.gate.gate.retry_after_s == 2.5
    cfg = load_config(UpConfig, toml_file("[prefill.engine]\nnum_blocks = 3\n[up]\nport = 1\n"),
                      ["prefill.engine.max_num_seqs=2"], env={})
    assert (cfg.prefill.engine.num_blocks, cfg.prefill.engine.max_num_seqs, cfg.up.port) == (3, 2, 1)
    with pytest.raises(ConfigError, match="prefill.engine.nope.*num_blocks"):
        load_config(UpConfig, overrides=["prefill.engine.nope=1"], env={})
    with pytest.raises(ConfigError, match="prefill.engine.*section"):
        load_config(UpConfig, overrides=["prefill.engine=1"], env={})


def test_describe_lists_leaf_keys():
    rows = describe(GateConfig)
    keys = [k for k, _, _ in rows]
    assert len(keys) == len(set(keys))
    assert {"instance", "load_interval_s", "bus.url", "bus.max_message_bytes", "tracing.exporter", "log.level",
            "gate.budget_fraction", "gate.admission_wait_s"} <= set(keys)
    assert "bus" not in keys and "gate" not in keys  # sections are not leaves
    by_key = {k: (tp, default) for k, tp, default in rows}
    assert by_key["bus.url"] == ("str", GateConfig().bus.url)
    assert by_key["gate.budget_fraction"] == ("float", GateSettings().budget_fraction)
    up_keys = {k for k, _, _ in describe(UpConfig)}
    assert {"up.port", "prefill.engine.num_blocks", "router.router.port", "decode.transfer.slots"} <= up_keys
    # every described key can be set back through load_config
    for key, _, default in rows:
        if isinstance(default, (str, int, float)) and not isinstance(default, bool) and default != "":
            assert load_config(GateConfig, overrides=[f"{key}={default}"], env={}) == GateConfig()


def _modified(cfg):
    """A copy with something changed in every section (values chosen to pass validation)."""
    cfg = dataclasses.replace(cfg, instance=cfg.instance + "-x", load_interval_s=0.25,
                              bus=dataclasses.replace(cfg.bus, url="nats://10.0.0.5:4222", prefix="p\"q",
                                                      max_message_bytes=1000, request_timeout_s=1.5),
                              tracing=dataclasses.replace(cfg.tracing, exporter="none", sample_ratio=0.5,
                                                          headers={"Authorization": "Bearer \\x \u00e9"}),
                              log=dataclasses.replace(cfg.log, level="debug", json=False))
    if hasattr(cfg, "gate"):
        cfg = dataclasses.replace(cfg, gate=dataclasses.replace(cfg.gate, budget_fraction=0.5, max_input_tokens=7))
    if hasattr(cfg, "engine"):
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, num_blocks=7, kv_dtype="bfloat16",
                                                                  enable_prefix_cache=False, tenant_salt="s\n1"),
                                  transfer=dataclasses.replace(cfg.transfer, slots=3, timeout_s=2.0))
    if hasattr(cfg, "router"):
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, port=0, api_keys=["a", "b c"],
                                                                  routing="p2c", served_model_name="m"))
    return cfg


@pytest.mark.parametrize("cls", [GateConfig, PrefillConfig, DecodeConfig, RouterConfig])
@pytest.mark.parametrize("modify", [False, True], ids=["default", "modified"])
def test_to_toml_round_trip(cls, modify, tmp_path):
    cfg = _modified(cls()) if modify else cls()
    assert cfg != cls() or not modify
    path = tmp_path / "cfg.toml"
    path.write_text(to_toml(cfg))
    assert load_config(cls, path, env={}) == cfg


def test_to_toml_round_trip_non_bmp_string(tmp_path):
    cfg = GateConfig(instance="gate-\U0001F600")
    path = tmp_path / "cfg.toml"
    path.write_text(to_toml(cfg))
    assert load_config(GateConfig, path, env={}) == cfg


def test_single_numeric_list_item():
    assert load_config(RouterConfig, overrides=["router.api_keys=12345"], env={}).router.api_keys == ["12345"]


# ---- the service CLI, as a user runs it --------------------------------------------------------------
def run_gate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.gate", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def test_cli_unknown_key_exits_2_with_known_keys():
    r = run_gate("--set", "gate.nope=1")
    assert r.returncode == 2, r.stderr
    assert "gate.nope" in r.stderr
    for known in ("budget_fraction", "admission_wait_s", "retry_after_s"):
        assert known in r.stderr


def test_cli_print_config():
    r = run_gate("--print-config")
    assert r.returncode == 0, r.stderr
    assert "bus.url" in r.stdout and "gate.budget_fraction" in r.stdout
