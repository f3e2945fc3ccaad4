"""A decoder in plain torch: Llama (RMSNorm, RoPE rotate-half, GQA, SwiGLU, tied embeddings), Qwen 2 (the
same with q/k/v biases), Qwen 3 (with per-head q/k RMSNorm instead) and Gemma 3 (the same, plus q/k RMSNorm,
norms on the attention's and the MLP's outputs, GeGLU, embeddings scaled by
sqrt(hidden), and local layers with a sliding window and a RoPE base of their own).

The model is stateless between calls: all KV lives in the page pool passed to `forward`, one tensor per
pipeline stage (see shared/kv_layout.py). Layer l reads and writes pages[stage_of(l)][:, local(l)].
A pipeline rank holds only its stage's layers (`layers`, shared/engine/pipeline.py): `run_layers` runs them
on the hidden states the previous rank sent; `forward` is embed -> run_layers -> final norm over them all. A
sliding-window layer keeps every token's KV like the others (the prefix cache, the pool and the handoff
are unchanged) and only attends to the last `window` of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import AttentionKernels, cpu_logits, get_attention_kernels
from shared.engine.attention import AttentionBatch, PrefillSegment, paged_attention, write_kv
from shared.engine.model_config import ModelConfig
from shared.engine.rope import RotaryEmbedding
from shared.kv_layout import KVLayout


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in fp32 whatever the compute dtype (as transformers does), then scaled in it; in fp32 the
    casts are no-ops."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every tensor a model of this shape reads, under our names: no more, no fewer."""
    names = ["embed_tokens", "norm"] + ([] if config.tie_embeddings else ["lm_head"])
    per_layer = ("input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "post_attention_layernorm",
                 "gate_proj", "up_proj", "down_proj")
    if config.uses_qk_norm:
        per_layer += ("q_norm", "k_norm")
    if config.qkv_bias:
        per_layer += ("q_proj.bias", "k_proj.bias", "v_proj.bias")
    if config.gemma:
        per_layer += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    for i in range(config.num_layers):
        names += [f"layers.{i}.{n}" for n in per_layer]
    return names


def _rows_only(batch: AttentionBatch, rows: list[int]) -> AttentionBatch:
    """The prefill batch for one query row per segment (each the segment's last): row j of the result is
    `rows[j]`, attending to all of its segment's context."""
    segments = []
    for j, r in enumerate(rows):
        seg = next(s for s in batch.prefill if s.q_start <= r < s.q_start + s.q_len)
        if r != seg.q_start + seg.q_len - 1:
            raise ValueError(f"row {r} is not the last of its segment")
        segments.append(PrefillSegment(j, 1, seg.ctx_len, seg.block_table))
    return AttentionBatch(batch.slot_blocks, batch.slot_offsets, prefill=segments)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], layout: KVLayout,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attention: AttentionKernels | None = None, layers: range | None = None):
        if layout.num_layers != config.num_layers or layout.num_kv_heads != config.num_kv_heads \
                or layout.head_dim != config.head_dim:
            raise ValueError("KV layout does not match the model config")
        self.config, self.layout, self.device, self.dtype = config, layout, torch.device(device), dtype
        self.span = layers if layers is not None else range(config.num_layers)
        if not (0 <= self.span.start <= self.span.stop <= config.num_layers and self.span.step == 1):
            raise ValueError(f"layer span {self.span} not within the model's {config.num_layers} layers")
        expected = [n for n in self.expected_weight_names()
                    if not n.startswith("layers.") or int(n.split(".")[1]) in self.span]
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()
             if not k.startswith("layers.") or int(k.split(".")[1]) in self.span}
        missing = [k for k in expected if k not in w]
        if missing:
            raise ValueError(f"missing weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")
        unknown = sorted(set(w) - set(self.expected_weight_names()))
        if unknown:  # never dropped without a word: a tensor this architecture does not use
            raise ValueError(f"weights this {config.arch} model does not use: {unknown[:5]}"
                             f"{'...' if len(unknown) > 5 else ''}")
        self.embed = w["embed_tokens"]
        self.lm_head = self.embed if config.tie_embeddings else w["lm_head"]
        self.norm = w["norm"]
        self.embed_scale = config.hidden_size ** 0.5 if config.gemma else None
        # Fused projections: one matmul for q|k|v and one for gate|up.
        self.layers = []
        for i in self.span:
            p = f"layers.{i}."
            layer = {
                "in_norm": w[p + "input_layernorm"],
                "qkv": torch.cat([w[p + "q_proj"], w[p + "k_proj"], w[p + "v_proj"]], dim=0).contiguous(),
                "qkv_bias": torch.cat([w[p + "q_proj.bias"], w[p + "k_proj.bias"], w[p + "v_proj.bias"]]).contiguous()
                if config.qkv_bias else None,
                "o": w[p + "o_proj"],
                "gate_up": torch.cat([w[p + "gate_proj"], w[p + "up_proj"]], dim=0).contiguous(),
                "down": w[p + "down_proj"],
            }
            if config.uses_qk_norm:
                layer.update(q_norm=w[p + "q_norm"], k_norm=w[p + "k_norm"])
            if config.gemma:
                layer.update(attn_out_norm=w[p + "post_attention_layernorm"],
                             mlp_norm=w[p + "pre_feedforward_layernorm"], mlp_out_norm=w[p + "post_feedforward_layernorm"])
            else:
                layer["mlp_norm"] = w[p + "post_attention_layernorm"]
            self.layers.append(layer)
        self.windows = [config.layer_window(i) for i in range(config.num_layers)]
        # cos/sin computed in fp64 and rounded once to the compute dtype (transformers rounds fp32 ones)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_context, self.device, dtype,
                                    config.rope_scaling)
        # Gemma 3's local layers rotate with a base of their own (Mistral's windowed layers share the global one)
        self.local_rope = (RotaryEmbedding(config.head_dim, config.rope_local_theta, config.max_context, self.device,
                                           dtype) if config.rope_local_theta and any(self.windows) else None)
        self.scale = (config.query_scale or config.head_dim) ** -0.5
        self.layer_stage = [layout.stage_of_layer(i) for i in range(config.num_layers)]
        # paged attention backend (MOORAGE_ATTN_KERNELS or auto); replace the attribute to switch
        self.attention = attention or get_attention_kernels(self.device)
        # context-parallel decode (shared/engine/context_parallel.py): writes and attends through the ranks
        self.context = None

    def expected_weight_names(self) -> list[str]:
        return expected_weight_names(self.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                pages: list[torch.Tensor], out_rows: list[int] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]; writes the new tokens' KV.
        `out_rows` (a prefill's rows that sample, each the last of its segment): only those rows' hidden
        states come back, [len(out_rows), hidden], and the last layer runs its attention, output projection
        and MLP for them alone (every row's K/V is still written: a prompt's other rows feed nothing after
        the last layer's K/V)."""
        return self.final_norm(self.run_layers(self.embed_tokens(input_ids), positions, batch, pages, out_rows))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[input_ids]
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # Gemma: rounded to the compute dtype first
        return x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm, self.config.rms_eps)

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                   pages: list[torch.Tensor | None], out_rows: list[int] | None = None) -> torch.Tensor:
        """This model's layers (`span`) on hidden states x [T, hidden]. `out_rows` acts in the model's last
        layer only (see forward): a span that holds it returns those rows alone. `pages` needs only the
        entries of the stages these layers live in."""
        c = self.config
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        last = c.num_layers - 1
        if out_rows is not None and batch.prefill is None:
            raise ValueError("out_rows is for a prefill batch (every decode row samples)")
        tables = self.rope.tables(positions)
        local_tables = self.local_rope.tables(positions) if self.local_rope is not None else None
        for i, L in zip(self.span, self.layers):
            stage, local = self.layer_stage[i]
            window = self.windows[i]
            h = rms_norm(x, L["in_norm"], c.rms_eps)
            qkv = F.linear(h, L["qkv"], L["qkv_bias"])
            cos, sin = local_tables if window and local_tables is not None else tables
            if c.uses_qk_norm:
                q = rms_norm(qkv[:, :hq * d].view(-1, hq, d), L["q_norm"], c.rms_eps)
                k = rms_norm(qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d), L["k_norm"], c.rms_eps)
                q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
            else:
                # q and k heads side by side in qkv: one RoPE pass over [T, hq + hkv, d] (a strided view)
                qk = self.rope.apply(qkv[:, :(hq + hkv) * d].view(-1, hq + hkv, d), cos, sin)
                q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
            if self.context is not None:  # every row, every layer: the ranks' shares merged
                attn = self.context.attend(i, q, k, v, self.scale, window)
            else:
                write_kv(pages[stage], local, batch, k, v)
                if out_rows is not None and i == last:
                    batch, rows = _rows_only(batch, out_rows), torch.tensor(out_rows, dtype=torch.long, device=x.device)
                    q, x = q[rows], x[rows]
                attn = paged_attention(q, pages[stage], local, batch, self.scale, self.attention, window)
            o = F.linear(attn.reshape(-1, hq * d), L["o"])
            x = x + (rms_norm(o, L["attn_out_norm"], c.rms_eps) if c.gemma else o)
            h = rms_norm(x, L["mlp_norm"], c.rms_eps)
            gate, up = F.linear(h, L["gate_up"]).chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if c.gemma else F.silu(gate)
            m = F.linear(act * up, L["down"])
            x = x + (rms_norm(m, L["mlp_out_norm"], c.rms_eps) if c.gemma else m)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return cpu_logits.logits(hidden, self.lm_head)  # torch's F.linear unless a few float32 rows on CPU
