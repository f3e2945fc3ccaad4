"""Tokenizers and the chat template: messages -> prompt token ids, in one function the router reuses.

Two kinds: the byte-level BPE stored in a GGUF file (SmolLM2's, built with `tokenizers`), and a plain
byte tokenizer for the seeded `tiny` preset. Both render chat with a Jinja template (the one in the GGUF
metadata when present, else ChatML) in a sandbox, then encode with special tokens recognised.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cached_property

from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CONTROL_TOKEN_TYPE = 3  # llama.cpp token type: control (special) token


class Tokenizer:
    """Common surface: encode, decode, special ids, chat rendering."""

    chat_template: str = CHATML_TEMPLATE
    eos_token_ids: tuple[int, ...] = ()
    special_tokens: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @cached_property
    def _template(self):
        return ImmutableSandboxedEnvironment(trim_blocks=False).from_string(self.chat_template)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The template's text for `messages` (each with a string 'role' and 'content'; other keys, such as
        an assistant's 'tool_calls', pass through). `tools` reaches templates that read it."""
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string 'role' and a string 'content'")
        extra = {"tools": tools} if tools else {}
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **extra)

    def chat_token_ids(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                       tools: list[dict] | None = None) -> list[int]:
        """The prompt a chat request becomes. Turn N+1's ids extend turn N's (same history prefix)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))


class BPETokenizer(Tokenizer):
    """Byte-level BPE held by a `tokenizers.Tokenizer`: from GGUF metadata or a tokenizer.json."""

    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...], chat_template: str | None):
        self._tok = hf_tokenizer
        self.special_tokens = {t.content: i for i, t in hf_tokenizer.get_added_tokens_decoder().items()
                               if t.special}
        self.eos_token_ids = eos_token_ids
        if chat_template:
            self.chat_template = chat_template

    @classmethod
    def from_gguf_reader(cls, reader, eos_token_ids: tuple[int, ...]) -> "BPETokenizer":
        """GGUF 'gpt2' style vocabulary + merges, e.g. SmolLM2's (pre-tokenizer 'smollm': single digits)."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        def field(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        if field("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer {field('tokenizer.ggml.model')!r} (only 'gpt2' BPE)")
        tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if field("tokenizer.ggml.pre", "default") in ("smollm", "starcoder", "refact"):
            digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
            tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty == _CONTROL_TOKEN_TYPE]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return cls(tok, eos_token_ids, field("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path, eos_token_ids: tuple[int, ...]) -> "BPETokenizer":
        import json
        from pathlib import Path

        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        template = None
        if (path / "tokenizer_config.json").exists():
            template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), eos_token_ids,
                   template if isinstance(template, str) else None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


class ByteTokenizer(Tokenizer):
    """Ids 0-255 are bytes; specials follow. For the seeded `tiny` preset (no merges to learn)."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self) -> None:
        self.special_tokens = {t: 256 + i for i, t in enumerate(self.SPECIALS)}
        self._id_to_special = {i: t for t, i in self.special_tokens.items()}
        self.eos_token_ids = (self.special_tokens["<|im_end|>"], self.special_tokens["<|endoftext|>"])
        self._split = re.compile("(" + "|".join(re.escape(t) for t in self.SPECIALS) + ")")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self.special_tokens:
                ids.append(self.special_tokens[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens and i in self._id_to_special:
                out.append(self._id_to_special[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)
