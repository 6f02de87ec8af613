"""A tiny byte-level BPE tokenizer with a Qwen3 chat template, for demo models and tests that need no download.

Like Qwen's real tokenizers it is byte-level BPE: the 256 single bytes are tokens 0..255 (in GPT-2's byte-to-unicode
alphabet, so any text round-trips), the Qwen3 control tokens follow at 256..260, and then come the tokens made by a few
hundred merges learnt from a small fixed English corpus (below) by a deterministic trainer in this module, so ordinary
English takes a fraction of a token per byte while every byte sequence still encodes. The files are what a Hugging Face
model directory holds, so both Strata and transformers load them.
"""
from __future__ import annotations

import functools
import json
from collections import Counter, defaultdict
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

# Special tokens in id order, right after the 256 byte tokens.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, THINK_ID, END_THINK_ID = range(256, 256 + len(SPECIAL_TOKENS))
FIRST_MERGED_ID = 256 + len(SPECIAL_TOKENS)  # merged tokens take ids 261, 262, ... in merge order

# The trainer stops once the real vocabulary (bytes + specials + merged tokens) reaches this size.
MAX_REAL_VOCAB = 1024

# The demo model's embedding rows: the real vocabulary (FIRST_MERGED_ID + one id per merge) rounded up to a multiple
# of 16. Written out rather than computed so importing this module trains nothing; write_demo_tokenizer
# checks it. Ids past the real vocabulary are valid model outputs and decode to nothing.
DEMO_VOCAB_SIZE = 624

# The text the merges are learnt from: ordinary English prose and a little Python, generic on purpose (it is not
# written around any test prompt). Changing it changes the tokenizer; the demo cache directory is named by a hash of this file, so that is safe.
CORPUS = """\
The morning was cool and clear, and the town was just beginning to wake. A baker on the corner had opened his
shutters an hour before dawn, and the smell of fresh bread drifted down the street. People walked to the station with
their coats buttoned up, carrying bags, books and cups of coffee. Some of them talked about the weather, some about the
news, and most of them said nothing at all.

In the old library near the square, the shelves were still in shadow. The librarian unlocked the front door, turned on
the lights and started to sort the books that had been returned the night before. There were novels and histories,
a few cookbooks, a guide to the mountains in the north, and a children's story about a fox who wanted to learn how to
read. She put each one back in its place, and she made a note of the ones that needed a new cover.

By noon the sun was high and the market was full. Farmers had come in from the country with apples, potatoes, onions,
cheese and eggs. A man was selling flowers from a small cart, and a woman with a loud voice was selling fish. Children
ran between the stalls while their parents looked for the best prices. It was a busy, noisy, ordinary day, and nobody
seemed to be in a hurry to go home.

Learning to write a program is a little like learning to cook. At first you follow the recipe exactly, one step after
another, and you are not always sure why each step is there. Then you start to notice patterns. You see that some
steps can be done in any order, that others must come first, and that a small change in one place can have a large
effect somewhere else. After a while you can read a new recipe and understand what it is trying to do before you have
even started.

A good program, like a good meal, is made from simple parts that fit together well. Each function should do one thing
and do it clearly. Names should say what a value means, not how it is stored. When something goes wrong, the error
message should tell the person reading it what happened, where it happened, and what they can do about it. These rules
are easy to state and hard to follow, which is why people keep writing about them.

In the evening the wind changed and clouds came in from the west. The first drops of rain fell on the roofs and the
streets emptied quickly. Lights came on in the windows one after another. In one house a family sat down to dinner and
talked about their day; in another an old man listened to music on the radio and read the paper. Later the rain
stopped, the sky cleared again, and the stars came out over the quiet town.

Questions are often more useful than answers. What would happen if we tried it the other way? Why does this work here
but not there? How do we know that the result is right? A careful person asks these questions again and again, not
because they doubt everything, but because they want to understand the world as it really is, and not only as they
would like it to be.

def count_words(text):
    \"\"\"Return a dictionary that maps each word in the text to the number of times it appears.\"\"\"
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\\"'()")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def most_common(counts, n=10):
    # Sort by count, highest first, and break ties by the word itself so the result is always the same.
    items = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return items[:n]


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)


if __name__ == "__main__":
    with open("notes.txt", encoding="utf-8") as file:
        for word, count in most_common(count_words(file.read())):
            print(f"{word}: {count}")
"""

# Qwen3's chat template (system/user/assistant/tool roles, tool calls, reasoning rendered inside <think> for the
# turns after the last user query, enable_thinking=false), preceded by a role check so a typo in a role is an error
# instead of a message that silently disappears from the prompt.
CHAT_TEMPLATE = r"""{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception("unknown message role '" ~ message.role ~ "'; allowed roles are system, user, assistant, tool") }}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def write_demo_tokenizer(dir: Path) -> int:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into `dir`; return the vocab size.

    The returned size (DEMO_VOCAB_SIZE) is the demo model's embedding size: the real tokens (bytes, specials and
    merged tokens) padded up to a multiple of 16, the way real checkpoints pad their vocabulary.
    """
    if _demo_vocab_size() != DEMO_VOCAB_SIZE:
        raise RuntimeError(f"DEMO_VOCAB_SIZE is {DEMO_VOCAB_SIZE} but the merges need {_demo_vocab_size()}; update it")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    _write_json(dir / "tokenizer.json", _tokenizer_json())
    _write_json(dir / "tokenizer_config.json", _tokenizer_config())
    generation_config = {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID}
    _write_json(dir / "generation_config.json", generation_config)
    return DEMO_VOCAB_SIZE


# Qwen3-VL's image placeholder: the processor expands <|image_pad|> into one token per merged patch
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID = range(DEMO_VOCAB_SIZE - 4, DEMO_VOCAB_SIZE - 4 + len(VISION_TOKENS))
_TEXT_CONTENT = """    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}"""
# a message's content parts: text as it is, an image as its placeholder (Qwen3.5's template does the same)
_PARTS_CONTENT = """    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set parts = namespace(text='') %}
        {%- for part in message.content %}
            {%- if part.type == 'image' or part.type == 'image_url' %}
                {%- set parts.text = parts.text + '<|vision_start|><|image_pad|><|vision_end|>' %}
            {%- elif part.type == 'text' %}
                {%- set parts.text = parts.text + part.text %}
            {%- endif %}
        {%- endfor %}
        {%- set content = parts.text %}
    {%- endif %}"""
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_TEXT_CONTENT, _PARTS_CONTENT)


def write_vision_tokenizer(dir: Path) -> int:
    """write_demo_tokenizer's files plus Qwen3-VL's image tokens (ids in the vocabulary's padding: VISION_START_ID,
    VISION_END_ID, IMAGE_PAD_ID) and a chat template that renders an image content part as their placeholder."""
    if VISION_CHAT_TEMPLATE == CHAT_TEMPLATE or _demo_vocab_size() - 4 != max(_merged_vocab().values()) + 1:
        raise RuntimeError("the vision tokens no longer fit the demo vocabulary's padding, or its template changed")
    vocab = write_demo_tokenizer(dir)
    backend = _Backend.from_str(json.dumps(_tokenizer_json()))
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in VISION_TOKENS])
    if backend.token_to_id(VISION_TOKENS[0]) != VISION_START_ID:
        raise RuntimeError(f"the vision tokens landed at {backend.token_to_id(VISION_TOKENS[0])}, not {VISION_START_ID}")
    _write_json(Path(dir) / "tokenizer.json", json.loads(backend.to_str()))
    config = _tokenizer_config()
    config["chat_template"] = VISION_CHAT_TEMPLATE
    config["added_tokens_decoder"].update({str(i): {**config["added_tokens_decoder"][str(ENDOFTEXT_ID)], "content": t}
                                           for i, t in enumerate(VISION_TOKENS, start=VISION_START_ID)})
    _write_json(Path(dir) / "tokenizer_config.json", config)
    return vocab


def write_filler_tokenizer(dir: Path, vocab_size: int) -> None:
    """The demo tokenizer over a vocabulary of vocab_size (a random-weights model at a real model's shapes): ids past
    the merged tokens are filler tokens " t<id>" that text never encodes to but that decode visibly, so every token
    such a model samples streams as text. Same chat template and control tokens as the demo's."""
    dir = Path(dir)
    write_demo_tokenizer(dir)
    vocab = _merged_vocab()
    byte = _bytes_to_unicode()[ord(" ")]
    vocab.update((f"{byte}t{i}", i) for i in range(max(vocab.values()) + 1, vocab_size))
    backend = _Backend(models.BPE(vocab=vocab, merges=list(_learn_merges())))
    backend.pre_tokenizer = _pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    _write_json(dir / "tokenizer.json", json.loads(backend.to_str()))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level tokenizers use to store raw bytes as vocab strings."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    # The remaining bytes (controls, space, ...) are shifted past 255 in byte order so every vocab string is visible.
    for shift, b in enumerate(b for b in range(256) if b not in mapping):
        mapping[b] = chr(256 + shift)
    return mapping


def _pre_tokenizer() -> pre_tokenizers.ByteLevel:
    # GPT-2's split regex (contractions, words with their leading space, numbers, punctuation runs, whitespace), so a
    # merge never crosses a word boundary; the same object splits the training corpus and the text being encoded.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@functools.lru_cache(maxsize=None)
def _learn_merges(corpus: str = CORPUS, max_vocab: int = MAX_REAL_VOCAB) -> tuple[tuple[str, str], ...]:
    """Byte-level BPE merges learnt from `corpus`, deterministically, in merge order.

    The corpus is split exactly as the tokenizer splits text, and pairs of adjacent symbols are counted inside each
    piece, weighted by how often the piece occurs. Each step merges the most frequent pair; ties go to the pair that
    sorts first as a (left, right) tuple of vocab strings (Python string order, i.e. by code point). Training stops
    when the real vocabulary reaches `max_vocab` tokens or when no pair occurs at least twice.
    """
    pieces = Counter(piece for piece, _ in _pre_tokenizer().pre_tokenize_str(corpus))
    words = [list(piece) for piece in pieces]  # each piece's symbols; a byte-level char is one byte
    freqs = list(pieces.values())
    pair_counts: Counter[tuple[str, str]] = Counter()
    pair_words: defaultdict[tuple[str, str], set[int]] = defaultdict(set)  # pair -> words it may occur in
    for index, (symbols, freq) in enumerate(zip(words, freqs)):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += freq
            pair_words[pair].add(index)

    vocab = set(_bytes_to_unicode().values())
    merges: list[tuple[str, str]] = []
    while len(vocab) + len(SPECIAL_TOKENS) < max_vocab and pair_counts:
        best, count = min(pair_counts.items(), key=lambda item: (-item[1], item[0]))
        if count < 2:
            break
        merges.append(best)
        merged = best[0] + best[1]
        vocab.add(merged)
        for index in sorted(pair_words.pop(best)):
            symbols, freq = words[index], freqs[index]
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] -= freq
            out, i = [], 0
            while i < len(symbols):  # left to right, non-overlapping, as the BPE model applies a merge
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            words[index] = out
            for pair in zip(out, out[1:]):
                pair_counts[pair] += freq
                pair_words[pair].add(index)
        for pair in [pair for pair, n in pair_counts.items() if n <= 0]:
            del pair_counts[pair]
    return tuple(merges)


def _merged_vocab() -> dict[str, int]:
    """The BPE model's vocabulary: bytes at 0..255, the special tokens, then each merge's new token in merge order."""
    vocab = {char: byte for byte, char in sorted(_bytes_to_unicode().items())}
    # The special tokens are in the model's vocabulary too (as GPT-2 has <|endoftext|>), so its ids are contiguous:
    # when the tokenizers library loads tokenizer.json it re-adds every added token, keeping the id of a token the
    # model knows and giving any other the next id past the model's vocabulary, which is taken by a merged token.
    # Text never reaches the model with a special token in it, and no merge builds one.
    vocab.update((token, token_id) for token_id, token in enumerate(SPECIAL_TOKENS, start=ENDOFTEXT_ID))
    next_id = FIRST_MERGED_ID
    for left, right in _learn_merges():
        if left + right not in vocab:  # a token two different merges can build gets the id of the first
            vocab[left + right] = next_id
            next_id += 1
    return vocab


def _demo_vocab_size() -> int:
    real = max(_merged_vocab().values()) + 1
    return -(-real // 16) * 16


def _tokenizer_json() -> dict:
    backend = _Backend(models.BPE(vocab=_merged_vocab(), merges=list(_learn_merges())))
    backend.pre_tokenizer = _pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return json.loads(backend.to_str())


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token_id, token in enumerate(SPECIAL_TOKENS, start=ENDOFTEXT_ID)
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _write_json(path: Path, value: dict) -> None:
    # Fixed formatting and key order (dicts keep insertion order), so every call writes the same bytes.
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
