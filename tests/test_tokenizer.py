"""Tokenizers and the chat template: ByteTokenizer (fast) and SmolLM2's GGUF BPE (slow: ~5 s to build)."""

from __future__ import annotations

import pytest

from shared.engine.tokenizer import CHATML_TEMPLATE, ByteTokenizer

SAMPLES = [
    "",
    "hello world",
    "héllo wörld — ünïcödé",
    "日本語のテキスト 😀🚀 emoji",
    "def f(x):\n    return x ** 2  # comment\n\tindent",
    "  leading and trailing spaces  ",
    "numbers 1234567890 and 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Réponds en français 😀"},
    {"role": "assistant", "content": "6."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def byte_tok() -> ByteTokenizer:
    return ByteTokenizer()


# ---- ByteTokenizer -------------------------------------------------------------------------------

@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip(byte_tok, text):
    ids = byte_tok.encode(text)
    assert all(0 <= i < byte_tok.vocab_size for i in ids)
    assert byte_tok.decode(ids, skip_special_tokens=False) == text


def test_byte_ids_are_utf8_bytes(byte_tok):
    assert byte_tok.encode("aé€") == list("aé€".encode("utf-8"))
    assert byte_tok.vocab_size == 259


def test_byte_specials(byte_tok):
    assert byte_tok.special_tokens == {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
    assert set(byte_tok.eos_token_ids) == {256, 258}
    ids = byte_tok.encode("<|im_start|>a<|im_end|><|endoftext|>")
    assert ids == [257, ord("a"), 258, 256]
    assert byte_tok.decode(ids, skip_special_tokens=True) == "a"
    assert byte_tok.decode(ids, skip_special_tokens=False) == "<|im_start|>a<|im_end|><|endoftext|>"
    # partial special-token text is ordinary bytes
    assert byte_tok.encode("<|im_") == list(b"<|im_")


def test_byte_decode_of_invalid_utf8_replaces(byte_tok):
    assert byte_tok.decode([0xE2, 0x82]) == "\ufffd"
    # a special token in between does not glue byte runs together
    assert byte_tok.decode([0xE2, 0x82, 258, 0xAC]) == "\ufffd\ufffd"


def test_byte_chat_render_is_chatml(byte_tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert byte_tok.chat_template == CHATML_TEMPLATE
    assert byte_tok.render_chat(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert byte_tok.render_chat(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    assert byte_tok.chat_token_ids(msgs) == byte_tok.encode(byte_tok.render_chat(msgs))


def test_template_does_not_evaluate_message_content(byte_tok):
    msgs = [{"role": "user", "content": "{{ 7 * 7 }} {% if true %}x{% endif %}"}]
    assert "{{ 7 * 7 }} {% if true %}x{% endif %}" in byte_tok.render_chat(msgs)


def _check_turns_extend(tok, conversation):
    """Turn N's prompt (with generation prompt) is a prefix of turn N+1's (history + reply + new user)."""
    user_turns = [i for i, m in enumerate(conversation) if m["role"] == "user"]
    for a, b in zip(user_turns, user_turns[1:]):
        turn_n = tok.chat_token_ids(conversation[:a + 1], add_generation_prompt=True)
        turn_n1 = tok.chat_token_ids(conversation[:b + 1], add_generation_prompt=True)
        assert len(turn_n1) > len(turn_n)
        assert turn_n1[:len(turn_n)] == turn_n
        assert tok.decode(turn_n, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_byte_chat_turns_extend(byte_tok):
    _check_turns_extend(byte_tok, CONVERSATION)
    _check_turns_extend(byte_tok, CONVERSATION[1:])  # no system message


@pytest.mark.parametrize("messages", [
    [{"content": "no role"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": ["a", "b"]}],
    [{"role": 1, "content": "x"}],
    [{"role": "user", "content": "ok"}, {"role": "assistant"}],
])
def test_bad_messages_raise_value_error(byte_tok, messages):
    with pytest.raises(ValueError):
        byte_tok.chat_token_ids(messages)


@pytest.mark.parametrize("messages", [["just a string"], [None], [("user", "hi")]])
def test_non_dict_messages_raise_value_error(byte_tok, messages):
    with pytest.raises(ValueError):
        byte_tok.chat_token_ids(messages)


# ---- SmolLM2 BPE from the bundled GGUF (slow) -------------------------------------------------------

# Source: Hugging Face transformers' own GGUF tokenizer + apply_chat_template on the same file (the
# independent oracle); tests/test_oracle_transformers.py re-derives and checks these ids on every run.
CAPITAL_OF_FRANCE_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
                         411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47,
                         2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def smol_tok():
    from gguf import GGUFReader

    from shared.engine.models import smollm2_gguf_path
    from shared.engine.tokenizer import BPETokenizer

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return BPETokenizer.from_gguf_reader(GGUFReader(str(path)), (2,))


@pytest.mark.slow
def test_smol_chat_prompt_known_ids(smol_tok):
    ids = smol_tok.chat_token_ids([{"role": "user", "content": "What is the capital of France?"}])
    assert ids == CAPITAL_OF_FRANCE_IDS


@pytest.mark.slow
def test_smol_template_from_gguf_adds_default_system(smol_tok):
    text = smol_tok.render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smol_special_tokens(smol_tok):
    assert smol_tok.special_tokens["<|endoftext|>"] == 0
    assert smol_tok.special_tokens["<|im_start|>"] == 1
    assert smol_tok.special_tokens["<|im_end|>"] == 2
    assert smol_tok.encode("<|endoftext|><|im_start|><|im_end|>") == [0, 1, 2]
    assert smol_tok.encode("<|im_start|>x<|im_end|>")[::2] == [1, 2]
    assert smol_tok.decode([1, *smol_tok.encode("hi"), 2], skip_special_tokens=True) == "hi"
    assert smol_tok.decode([1, *smol_tok.encode("hi"), 2], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert smol_tok.eos_token_ids == (2,)
    assert smol_tok.vocab_size == 49152


@pytest.mark.slow
def test_smol_digits_split_one_per_token(smol_tok):
    for number in ("7", "42", "1234567890", "3.14159", "x=2025;"):
        ids = smol_tok.encode(number)
        digits = [smol_tok.decode([i]) for i in ids if smol_tok.decode([i]).isdigit()]
        assert "".join(digits) == "".join(c for c in number if c.isdigit())
        assert all(len(d) == 1 for d in digits)
    assert len(smol_tok.encode("1234567890")) == 10


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_smol_round_trip(smol_tok, text):
    assert smol_tok.decode(smol_tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_smol_chat_turns_extend(smol_tok):
    _check_turns_extend(smol_tok, CONVERSATION)
    _check_turns_extend(smol_tok, CONVERSATION[1:])
