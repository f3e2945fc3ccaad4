"""Tokenizers and the chat template: messages -> prompt token ids, in one function the router reuses.

Kinds: the BPE stored in a GGUF file, built with `tokenizers` from the file's own metadata: GPT-2 byte-level
BPE (`tokenizer.ggml.model = gpt2`: SmolLM2) or SentencePiece BPE with byte fallback (`llama`: Gemma, whose
merges are derived from the vocabulary's scores, as SentencePiece ranks them); and a plain byte tokenizer
for the seeded `tiny` preset. All render chat with a Jinja template (the file's own when present, else
Gemma's turn format for Gemma, else ChatML) in a sandbox, then encode with special tokens recognised. A
tokenizer that says so (`add_bos`) starts every prompt with its BOS token.
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
# Gemma's turns (its base models ship no template): the system prompt opens the first user turn.
GEMMA_TEMPLATE = (
    "{{ '<bos>' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n'"
    " + (first if loop.first else '') + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_NORMAL, _UNKNOWN, _CONTROL_TOKEN_TYPE, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6  # llama.cpp token types
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte alphabet, reversed: the character a byte-level BPE spells each byte with -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_GPT2_BYTE = _gpt2_byte_decoder()


class Tokenizer:
    """Common surface: encode, decode, special ids, chat rendering."""

    chat_template: str = CHATML_TEMPLATE
    eos_token_ids: tuple[int, ...] = ()
    special_tokens: dict[str, int] = {}
    bos_token: str = ""  # prepended to every prompt that does not start with it ("" = none)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in the output text (a special token: its name). A token that holds
        part of a multi-byte character has those bytes alone, as OpenAI's per-token `bytes` does."""
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

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


# Pre-tokenizer splits by GGUF `tokenizer.ggml.pre` (llama.cpp's names), as the families' tokenizer.json spell them
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "tekken": _TEKKEN_SPLIT}
_DIGIT_PRE = frozenset({"smollm", "starcoder", "refact"})  # GPT-2's split after single digits


class BPETokenizer(Tokenizer):
    """Byte-level BPE held by a `tokenizers.Tokenizer`: from GGUF metadata or a tokenizer.json."""

    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...], chat_template: str | None, bos_token: str = ""):
        self._tok = hf_tokenizer
        self.special_tokens = {t.content: i for i, t in hf_tokenizer.get_added_tokens_decoder().items()
                               if t.special}
        self.eos_token_ids = eos_token_ids
        self.bos_token = bos_token
        if chat_template:
            self.chat_template = chat_template

    @classmethod
    def from_gguf_reader(cls, reader, eos_token_ids: tuple[int, ...]) -> "BPETokenizer":
        """The GGUF file's tokenizer: 'gpt2' byte-level BPE (SmolLM2) or 'llama' SentencePiece (Gemma)."""
        def field(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        model = field("tokenizer.ggml.model")
        if model == "llama":
            return cls._from_sentencepiece(field, eos_token_ids)
        if model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer {model!r} (gpt2 BPE or llama SentencePiece)")
        return cls._from_gpt2(field, eos_token_ids)

    @classmethod
    def _from_sentencepiece(cls, field, eos_token_ids: tuple[int, ...]) -> "BPETokenizer":
        """SentencePiece BPE with byte fallback from GGUF metadata (tokens, scores, types). Merges: every
        split of a normal token into two tokens of the vocabulary, ranked by the merged token's score (ties by
        the halves' ids), which is how SentencePiece's BPE picks its next merge."""
        from tokenizers import AddedToken, decoders, models, normalizers
        from tokenizers import Tokenizer as HFTokenizer

        tokens, scores, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"), field("tokenizer.ggml.token_type")
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in ("default", None):
            raise ValueError(f"unsupported SentencePiece pre-tokenizer {pre!r}")
        vocab = {t: i for i, t in enumerate(tokens)}
        ranked = []
        for i, t in enumerate(tokens):
            if types[i] != _NORMAL:
                continue
            splits = sorted((vocab[t[:j]], vocab[t[j:]]) for j in range(1, len(t)) if t[:j] in vocab and t[j:] in vocab)
            ranked += [(-scores[i], n, tokens[a], tokens[b]) for n, (a, b) in enumerate(splits)]
        ranked.sort(key=lambda r: r[0])  # stable: ties keep the order above
        unk = next((t for t, ty in zip(tokens, types) if ty == _UNKNOWN), None)
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in ranked], unk_token=unk,
                                     byte_fallback=True, fuse_unk=True))
        space_prefix = bool(field("tokenizer.ggml.add_space_prefix", False))
        tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if space_prefix else [])
                                              + [normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL_TOKEN_TYPE])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        bos = field("tokenizer.ggml.bos_token_id")
        add_bos = bool(field("tokenizer.ggml.add_bos_token", False)) and bos is not None
        template = field("tokenizer.chat_template") or (GEMMA_TEMPLATE if "<start_of_turn>" in vocab else None)
        return cls(tok, eos_token_ids, template, tokens[bos] if add_bos else "")

    @classmethod
    def _from_gpt2(cls, field, eos_token_ids: tuple[int, ...]) -> "BPETokenizer":
        """GGUF 'gpt2' style vocabulary + merges: SmolLM2's (pre-tokenizer 'smollm': single digits), Llama 3's
        ('llama-bpe': digits in threes), Qwen 2/2.5/3's ('qwen2': single digits) and Mistral Nemo / Devstral's
        ('tekken'). The splits are the ones transformers applies to the same files (its GGUF tokenizer
        mapping), so ids are identical to its tokenizer's (tests/test_gguf_families.py)."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = field("tokenizer.ggml.pre", "default")
        if pre in _DIGIT_PRE:
            digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        elif pre in ("default", "gpt-2", "gpt2"):
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif pre in _SPLITS:  # the family's own split, then bytes (as its tokenizer.json does)
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:  # other families split text their own way: never tokenized as if they were GPT-2's
            raise ValueError(f"unsupported BPE pre-tokenizer {pre!r} (default, gpt-2, "
                             f"{', '.join(sorted(_DIGIT_PRE | set(_SPLITS)))})")
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty == _CONTROL_TOKEN_TYPE]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        bos = field("tokenizer.ggml.bos_token_id")
        add_bos = bool(field("tokenizer.ggml.add_bos_token", False)) and bos is not None  # Llama 3's <|begin_of_text|>
        return cls(tok, eos_token_ids, field("tokenizer.chat_template"), tokens[bos] if add_bos else "")

    @classmethod
    def from_hf_dir(cls, path, eos_token_ids: tuple[int, ...]) -> "BPETokenizer":
        import json
        from pathlib import Path

        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        template = None
        if (path / "tokenizer_config.json").exists():
            template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        if (path / "chat_template.jinja").exists():  # where transformers 4.50+ saves it
            template = (path / "chat_template.jinja").read_text()
        return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), eos_token_ids,
                   template if isinstance(template, str) else None)

    def encode(self, text: str) -> list[int]:
        if self.bos_token and not text.startswith(self.bos_token):
            text = self.bos_token + text
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def _byte_level(self) -> bool:
        """Whether tokens are spelled in GPT-2's byte alphabet (a ByteLevel decoder, alone or in a sequence)."""
        import json

        dec = json.loads(self._tok.to_str()).get("decoder") or {}
        return dec.get("type") == "ByteLevel" or any(d.get("type") == "ByteLevel" for d in dec.get("decoders", []))

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:  # specials and user-defined tokens are their own text
            return piece.encode("utf-8")
        if self._byte_level:
            return b"".join(bytes([_GPT2_BYTE[c]]) if c in _GPT2_BYTE else c.encode("utf-8") for c in piece)
        if _BYTE_PIECE.fullmatch(piece):  # SentencePiece's byte fallback, <0xE2>
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    @cached_property
    def _added(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())


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

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else self._id_to_special.get(token_id, "").encode("utf-8")

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
