"""Tokenizer: byte-level BPE round trips, streaming decode, and chat prompts identical to transformers' own."""
from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from strata.demo_tokenizer import (
    CORPUS,
    DEMO_VOCAB_SIZE,
    ENDOFTEXT_ID,
    FIRST_MERGED_ID,
    IM_END_ID,
    IM_START_ID,
    SPECIAL_TOKENS,
    THINK_ID,
    _bytes_to_unicode,
    _learn_merges,
    write_demo_tokenizer,
)
from strata.errors import ModelLoadError, StrataError
from strata.tokenizer import ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo")
    write_demo_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(demo_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def hf_tok(demo_dir):
    return transformers.PreTrainedTokenizerFast.from_pretrained(demo_dir)


def _copy_demo(demo_dir: Path, dest: Path) -> Path:
    shutil.copytree(demo_dir, dest)
    return dest


def _token_bytes(tok: Tokenizer, ids) -> bytes:
    """The raw bytes behind non-special ids, read from the vocabulary strings (GPT-2's byte-to-unicode alphabet)."""
    byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
    return bytes(byte_of[char] for i in ids for char in tok.id_to_token(i))


def _edit_config(path: Path, **changes) -> None:
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


# -- demo tokenizer files ---------------------------------------------------------------------------------------------


def test_demo_tokenizer_is_deterministic(tmp_path):
    sizes = [write_demo_tokenizer(tmp_path / name) for name in ("a", "b")]
    assert sizes == [DEMO_VOCAB_SIZE, DEMO_VOCAB_SIZE] == [624, 624]
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_demo_vocab_special_tokens_and_eos(tok):
    merges = _learn_merges()
    assert tok.vocab_size == FIRST_MERGED_ID + len(merges) == 620
    assert DEMO_VOCAB_SIZE % 16 == 0 and DEMO_VOCAB_SIZE - 16 < tok.vocab_size <= DEMO_VOCAB_SIZE
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(256, 261))
    # Bytes keep ids 0..255; merged tokens follow the special tokens in merge order.
    assert [tok.id_to_token(b) for b in range(256)] == [_bytes_to_unicode()[b] for b in range(256)]
    assert [tok.id_to_token(FIRST_MERGED_ID + n) for n in range(len(merges))] == [a + b for a, b in merges]
    assert tok.eos_token == "<|im_end|>" and tok.bos_token is None
    assert tok.eos_token_ids == [IM_END_ID, ENDOFTEXT_ID]
    assert tok.encode("<|im_start|>user<think>") == [IM_START_ID, *tok.encode("user"), THINK_ID]
    # Padded embedding rows past the real vocabulary decode to nothing instead of failing.
    assert tok.decode([ord("a"), tok.vocab_size, DEMO_VOCAB_SIZE - 1, ord("b")]) == "ab"
    assert tok.decode([IM_START_ID, ord("a"), IM_END_ID], skip_special_tokens=True) == "a"


# -- encode / decode --------------------------------------------------------------------------------------------------

_NO_SPECIALS = st.text().filter(lambda s: not any(t in s for t in SPECIAL_TOKENS))


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_control_characters_emoji_and_cjk_round_trip_in_both_tokenizers(tok, hf_tok):
    text = "\x00\x01\x1b[0m\x7f\r\n\t\u200d\ufeff é 世界 한국어 🎉👍🏽👨‍👩‍👧 𝔘 \U0010ffff The end.\n"
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(_NO_SPECIALS)
def test_tokens_spell_out_the_utf8_bytes(tok, text):
    # Whatever the merges, the tokens' bytes concatenate to exactly the text's UTF-8 bytes (nothing lost or unknown).
    ids = tok.encode(text)
    assert len(ids) <= len(text.encode("utf-8"))
    assert _token_bytes(tok, ids) == text.encode("utf-8")


@settings(max_examples=100, deadline=None)
@given(st.binary())
def test_every_byte_sequence_is_a_sequence_of_byte_tokens(tok, hf_tok, data):
    # Ids 0..255 are the raw bytes, so any byte string is a valid id sequence (a model may emit invalid UTF-8).
    ids = list(data)
    assert _token_bytes(tok, ids) == data
    assert tok.decode(ids) == hf_tok.decode(ids) == data.decode("utf-8", errors="replace")


@pytest.mark.parametrize("char", [*map(chr, range(128)), "é", "世", "🎉"], ids=ascii)
def test_one_character_repeated_round_trips(tok, hf_tok, char):
    for n in (1, 2, 3, 5, 17, 300):
        text = char * n
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert _token_bytes(tok, ids) == text.encode("utf-8")


def test_encode_matches_transformers(tok, hf_tok):
    text = "héllo <|im_start|>wörld 世界 🎉</think>\n\ttabs"
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_encode_matches_transformers_on_any_text(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


# -- the merges -------------------------------------------------------------------------------------------------------

# Ordinary English that is not in the training corpus.
HELD_OUT_PROSE = (
    "When the train was late again, the people on the platform looked at their phones and then at each other. "
    "A student in a green jacket said that it happened every week, and an older woman told him that it had been "
    "the same when she was young. They talked for a while about the city, about the price of bread and about a "
    "film they had both seen, and when the train finally came they found that they were going to the same place.\n"
)


def test_english_takes_fewer_than_half_a_token_per_byte(tok):
    assert HELD_OUT_PROSE not in CORPUS
    for name, text in [("held-out prose", HELD_OUT_PROSE), ("training corpus", CORPUS)]:
        ids = tok.encode(text)
        ratio = len(ids) / len(text.encode("utf-8"))
        print(f"{name}: {len(text.encode('utf-8'))} bytes -> {len(ids)} tokens ({ratio:.3f} tokens/byte)")
        assert ratio < 0.5, name
        assert tok.decode(ids) == text


def test_corpus_is_not_tailored_to_the_test_prompts():
    # The server tests' long prompts are about a heron and a barge; the merges must not have been learnt from them.
    words = CORPUS.lower()
    assert "heron" not in words and "barge" not in words


def test_merges_stay_inside_words(tok):
    # Text is split GPT-2 style (words with their leading space, numbers, punctuation, whitespace) before the merges,
    # so every merged token is a single piece of that split and never spans two words.
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True).pre_tokenize_str
    for token_id in range(FIRST_MERGED_ID, tok.vocab_size):
        token = tok.id_to_token(token_id)
        assert [piece for piece, _ in split(tok.decode([token_id]))] == [token]
    assert tok.encode("the the") == tok.encode("the") + tok.encode(" the")


def test_trainer_picks_most_frequent_pair_ties_by_string_order_and_stops():
    # Pieces: "xy", " xy", " ba" twice. (x,y), (Ġ,b) and (b,a) all occur twice; "b" < "x" < "Ġ" decides the order, and
    # training stops once no pair occurs twice (Ġ+x occurs once).
    assert _learn_merges("xy xy ba ba") == (("b", "a"), ("x", "y"), ("Ġ", "ba"))
    # Counts are weighted by how often a piece occurs; the vocabulary cap (bytes + specials + merges) stops it early.
    assert _learn_merges("abab abab") == (("a", "b"), ("ab", "ab"))
    assert _learn_merges("xy xy ba ba", max_vocab=FIRST_MERGED_ID + 2) == (("b", "a"), ("x", "y"))


# -- streaming decode -------------------------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids, **kwargs) -> list[str]:
    decoder = tok.decode_stream(**kwargs)
    chunks = [decoder.push(i) for i in ids]
    return chunks + [decoder.flush()]


def test_stream_multibyte_text_token_by_token(tok):
    # Merged tokens for the words, raw byte ids (0..255) for the 2-, 3- and 4-byte characters, so each of those is
    # split over several tokens the way a model may generate it.
    ids = [*tok.encode("the word "), *"é".encode(), *tok.encode(" and "), *"中文".encode(), *"🎉𝔘".encode()]
    ids += tok.encode(" ok")
    text = "the word é and 中文🎉𝔘 ok"
    chunks = _stream(tok, ids)
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == tok.decode(ids) == text
    # A character is emitted by the push of its last byte, never before and never later.
    start = ids.index(0xF0)
    assert chunks[start:start + 4] == ["", "", "", "🎉"]
    assert chunks[start + 4:start + 8] == ["", "", "", "𝔘"]


def _raw_bytes(tok, text):
    return list(text.encode("utf-8"))


@pytest.mark.parametrize("encode", [Tokenizer.encode, _raw_bytes], ids=["bpe", "raw-bytes"])
@settings(max_examples=150, deadline=None)
@given(text=_NO_SPECIALS.filter(lambda s: "\ufffd" not in s))
def test_stream_emits_each_character_once_complete(tok, encode, text):
    ids = encode(tok, text)
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == text
    assert chunks[-1] == ""  # nothing left over: every character completed inside the stream
    emitted = ""
    for n, chunk in enumerate(chunks[:-1], start=1):
        assert "\ufffd" not in chunk
        emitted += chunk
        # Exactly the characters whose bytes are all among the first n ids have been emitted.
        assert emitted == _token_bytes(tok, ids[:n]).decode("utf-8", errors="ignore")


def test_stream_flushes_incomplete_character_at_end(tok):
    ids = [ord("x"), 0xE4, 0xB8]  # "x" then the first two of the three bytes of 中
    chunks = _stream(tok, ids)
    assert chunks == ["x", "", "", "\ufffd"]
    assert "".join(chunks) == tok.decode(ids)


def test_stream_with_special_tokens_and_prompt_context(tok):
    prompt = tok.encode("<|im_start|>assistant\n")
    generated = tok.encode("<think>\nhmm ü\n</think>\n\nanswer é<|im_end|>")
    decoder = tok.decode_stream(prompt_ids=prompt)
    text = "".join(decoder.push(i) for i in generated) + decoder.flush()
    assert text == tok.decode(generated)  # the prompt is context only, never emitted
    skipped = "".join(_stream(tok, generated, skip_special_tokens=True))
    assert skipped == tok.decode(generated, skip_special_tokens=True) == "\nhmm ü\n\n\nanswer é"


# -- chat template, compared with transformers ------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville <city> & région",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "城市"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Héllo, 世界!"},
    ],
    "user_only": [{"role": "user", "content": "2+2?"}],
    "multi_turn_reasoning": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two.\n"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "\n6", "reasoning_content": "\nThree plus three is six."},
    ],
    "inline_think_and_reasoning_alias": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\ngreeting\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!", "reasoning": "farewell"},
    ],
    "tool_calls": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}},
            ],
        },
        {"role": "tool", "content": "12°C"},
        {"role": "tool", "content": "10°C"},
        {"role": "assistant", "content": "12°C in Zürich."},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}, {"enable_thinking": True}], ids=str)
def test_chat_template_matches_transformers(tok, hf_tok, name, add_generation_prompt, extra):
    messages = CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if name == "tool_calls" else None
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    theirs = hf_tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
    )
    assert ours == theirs
    assert tok.encode(ours) == hf_tok.encode(theirs, add_special_tokens=False)


def test_chat_template_shapes(tok):
    prompt = tok.apply_chat_template(CONVERSATIONS["system_user"])
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHéllo, 世界!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_think = tok.apply_chat_template(CONVERSATIONS["user_only"], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reasoning = tok.apply_chat_template(CONVERSATIONS["multi_turn_reasoning"], add_generation_prompt=False)
    assert reasoning.endswith("<|im_start|>assistant\n<think>\nThree plus three is six.\n</think>\n\n6<|im_end|>\n")
    with_tools = tok.apply_chat_template(CONVERSATIONS["tool_calls"], tools=[WEATHER_TOOL])
    # tojson keeps non-ASCII and HTML characters as they are.
    assert '"description": "Météo actuelle d\'une ville <city> & région"' in with_tools


def test_chat_template_does_not_mutate_messages(tok):
    messages = json.loads(json.dumps(CONVERSATIONS["tool_calls"]))
    tok.apply_chat_template(messages, tools=[WEATHER_TOOL])
    assert messages == CONVERSATIONS["tool_calls"]


FEATURE_TEMPLATE = """{{ bos_token if bos_token is defined else 'no-bos' }}|{{ eos_token }}|{{ documents is none }}
{%- set ns = namespace(count=0) %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {% generation %}{{ m.role }}={{ m.content | tojson }}{% endgeneration %}
{% endfor %}
{{ ns.count }} {{ dict(a=1, b='ü') | tojson(indent=2) }} {{ tools | tojson(sort_keys=true) }} {{ custom_flag }}
{{ messages[0] | tojson(separators=(',', ':')) }} {{ strftime_now('%Y') | length }}
{% if add_generation_prompt %}GO{% endif %}"""


def test_jinja_file_templates_and_environment_match_transformers(demo_dir, tmp_path):
    path = _copy_demo(demo_dir, tmp_path / "model")
    (path / "chat_template.jinja").write_text(FEATURE_TEMPLATE)  # overrides tokenizer_config's chat_template
    messages = [
        {"role": "user", "content": "a<b>&'ü'"},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "x", "reasoning_content": None},
        {"role": "user", "content": "y"},
        {"role": "user", "content": "z"},
    ]
    kwargs = dict(tools=[WEATHER_TOOL], custom_flag="on", add_generation_prompt=True)
    ours = Tokenizer.from_dir(path).apply_chat_template(messages, **kwargs)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(path).apply_chat_template(
        messages, tokenize=False, **kwargs
    )
    assert ours == theirs
    assert ours.startswith("no-bos|<|im_end|>|True") and ours.endswith(f"{len(str(datetime.now().year))}\nGO")


def test_template_list_picks_default_or_tool_use(demo_dir, tmp_path):
    path = _copy_demo(demo_dir, tmp_path / "model")
    templates = [
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        {"name": "default", "template": "default:{{ messages | length }}"},
    ]
    # eos_token as a serialized AddedToken, the way older transformers versions saved it.
    eos = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    _edit_config(path, chat_template=templates, eos_token=eos)
    tok = Tokenizer.from_dir(path)
    assert tok.chat_template_names == ["default", "tool_use"]
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "default:1"
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL]) == "tools:1"
    assert tok.eos_token_ids == [ENDOFTEXT_ID, IM_END_ID]  # the tokenizer's own eos first, then generation_config's
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    assert hf.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False) == "tools:1"
    assert hf.eos_token == tok.eos_token == "<|endoftext|>"


# -- loading details and errors ---------------------------------------------------------------------------------------


def test_eos_ids_merge_generation_config_and_config(demo_dir, tmp_path):
    path = _copy_demo(demo_dir, tmp_path / "model")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ENDOFTEXT_ID}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": [IM_END_ID, 270]}))
    assert Tokenizer.from_dir(path).eos_token_ids == [IM_END_ID, ENDOFTEXT_ID, 270]


def test_added_tokens_decoder_adds_tokens_missing_from_tokenizer_json(demo_dir, tmp_path):
    path = _copy_demo(demo_dir, tmp_path / "model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    entry = {"content": "<tool_call>", "special": False, "lstrip": False, "rstrip": False, "normalized": False}
    next_id = Tokenizer.from_dir(path).vocab_size
    config["added_tokens_decoder"][str(next_id)] = entry
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(path)
    assert tok.encode("a<tool_call>") == [ord("a"), next_id] and tok.vocab_size == next_id + 1

    config["added_tokens_decoder"][str(next_id + 40)] = {**entry, "content": "<far_away>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"'<far_away>' at id {next_id + 40}.*next free id is {next_id + 1}"):
        Tokenizer.from_dir(path)


def test_missing_tokenizer_json_names_the_path(demo_dir, tmp_path):
    path = _copy_demo(demo_dir, tmp_path / "model")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_dir(path)
    assert isinstance(info.value, StrataError)
    assert str(path / "tokenizer.json") in str(info.value) and "not found" in str(info.value)


def test_missing_model_dir_and_bad_json(tmp_path, demo_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    path = _copy_demo(demo_dir, tmp_path / "model")
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"cannot read .*tokenizer_config\.json"):
        Tokenizer.from_dir(path)


def test_unknown_role_is_a_strata_error_naming_role_and_allowed_ones(tok):
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template([{"role": "narrator", "content": "Once upon a time"}])
    assert isinstance(info.value, StrataError)
    message = str(info.value)
    assert "rejected the conversation" in message and "tokenizer_config.json" in message
    assert "unknown message role 'narrator'" in message
    assert "allowed roles are system, user, assistant, tool" in message


def test_template_failures_are_strata_errors(demo_dir, tmp_path, tok):
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="tools must be JSON-schema dicts"):
        tok.apply_chat_template(CONVERSATIONS["user_only"], tools=[print])

    path = _copy_demo(demo_dir, tmp_path / "model")
    (path / "chat_template.jinja").write_text("ok\n{% if %}")
    with pytest.raises(ChatTemplateError, match=r"does not compile: .*template line 2"):
        Tokenizer.from_dir(path).apply_chat_template(CONVERSATIONS["user_only"])

    (path / "chat_template.jinja").write_text("line1\n{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match=r"failed at template line 2: TypeError"):
        Tokenizer.from_dir(path).apply_chat_template(CONVERSATIONS["user_only"])

    # The sandbox is immutable: templates cannot mutate the caller's data.
    (path / "chat_template.jinja").write_text("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        Tokenizer.from_dir(path).apply_chat_template(CONVERSATIONS["user_only"])

    (path / "chat_template.jinja").unlink()
    _edit_config(path, chat_template=None)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        Tokenizer.from_dir(path).apply_chat_template(CONVERSATIONS["user_only"])
