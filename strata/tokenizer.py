"""Text <-> token ids for a Hugging Face model directory, and chat prompts rendered the way transformers renders them.

The fast-tokenizer file (tokenizer.json) does the encoding and decoding through the `tokenizers` library; the chat
template is rendered with jinja2 in the same sandboxed environment that transformers' `apply_chat_template` builds, so
a prompt made here is byte-for-byte the prompt the model was trained and evaluated with.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import re
import sys
import threading
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from strata.errors import ModelLoadError, StrataError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# The named special tokens transformers hands to every chat template as variables (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Names a message's reasoning may arrive under; chat templates read `reasoning_content` (gpt-oss reads `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Special tokens that stay parsed inside message text: reasoning tags are markup that chat templates split out of a
# message's content themselves (Qwen3's and DeepSeek's tokenizers do not even mark them special).
_MESSAGE_MARKUP = ("<think>", "</think>")

# A text this long is encoded with the GIL released (encode_batch), so the event loop keeps running meanwhile.
_LONG_TEXT = 1 << 16

# jinja2 before 3.1.6 has known sandbox escapes, and chat templates are untrusted code from model repositories.
_MIN_JINJA = (3, 1, 6)


class ChatTemplateError(StrataError, ValueError):
    """A chat template that cannot be found, compiled or rendered for the given conversation."""


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """What the template's own `raise_exception(...)` throws, kept apart so its message is shown as the reason."""


@dataclasses.dataclass(frozen=True)
class _ChatTemplate:
    text: str
    source: str  # the file it came from, for error messages


class Tokenizer:
    """A model directory's tokenizer: encode/decode, chat prompts, end-of-sequence ids, streaming decode."""

    def __init__(
        self,
        backend: _Backend,
        chat_templates: dict[str, _ChatTemplate],
        special_tokens: dict[str, str],
        eos_token_ids: list[int],
        source: Path,
    ):
        self._backend = backend
        self._chat_templates = chat_templates
        self._special_tokens = special_tokens
        self._compiled: dict[str, jinja2.Template] = {}
        self.eos_token_ids = eos_token_ids
        self.source = source
        # One past the highest id the tokenizer knows. A model's embedding is often padded larger; the ids in the
        # padding are valid model outputs and decode to nothing.
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self._special_in_text = None        # (regex of the special tokens, their ids as plain text): on first use
        self._max_token_chars: int | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat templates and eos ids from a Hugging Face model dir."""
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {path} does not exist or is not a directory")
        backend = _load_backend(path / TOKENIZER_FILE)
        config_path = path / TOKENIZER_CONFIG_FILE
        config = _read_json_object(config_path) if config_path.is_file() else {}
        _add_missing_added_tokens(backend, config.get("added_tokens_decoder") or {}, config_path)
        special_tokens = _named_special_tokens(config, config_path)
        eos_ids = _eos_token_ids(path, backend, special_tokens.get("eos_token"), config_path)
        return cls(backend, _load_chat_templates(path, config, config_path), special_tokens, eos_ids, path)

    # -- text <-> ids ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings inside it (e.g. `<|im_start|>`) become their single ids, or with
        parse_special=False are read as the text they are. A long text is encoded with the GIL released, and the
        memory its encoding took is given back to the system afterwards."""
        if not parse_special:
            pattern, _ = self._specials()
            if pattern is not None and pattern.search(text):
                return self._encode_protected(text, add_special_tokens, pattern)
        if len(text) < _LONG_TEXT:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        release_freed_memory()
        return ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to: a text of n characters is at least n / max_token_chars
        tokens, a bound that costs nothing to check before encoding."""
        if self._max_token_chars is None:
            longest = max((len(self._backend.decode([i], skip_special_tokens=False))
                           for i in self._backend.get_vocab(with_added_tokens=True).values()), default=1)
            self._max_token_chars = max(longest, 1)
        return self._max_token_chars

    def _specials(self):
        """The special tokens that message text must not produce: a regex matching their text, and each one's ids
        when read as plain text."""
        with self._lock:
            if self._special_in_text is None:
                names = sorted((t.content for t in self._backend.get_added_tokens_decoder().values()
                                if t.special and t.content and t.content not in _MESSAGE_MARKUP), key=len, reverse=True)
                as_text = _Backend.from_str(self._backend.to_str())
                as_text.encode_special_tokens = True
                ids = {name: as_text.encode(name, add_special_tokens=False).ids for name in names}
                pattern = re.compile("|".join(re.escape(n) for n in names)) if names else None
                self._special_in_text = (pattern, ids)
            return self._special_in_text

    def _encode_protected(self, text: str, add_special_tokens: bool, pattern: re.Pattern) -> list[int]:
        _, as_text = self._specials()
        ids: list[int] = []
        at = 0
        for m in pattern.finditer(text):
            ids += self.encode(text[at:m.start()]) if m.start() > at else []
            ids += as_text[m.group()]
            at = m.end()
        ids += self.encode(text[at:]) if at < len(text) else []
        if add_special_tokens:   # the post-processor's tokens around the whole text (BOS and the like)
            empty = self._backend.encode("", add_special_tokens=True).ids
            ids = empty[:1] + ids if empty else ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; incomplete UTF-8 byte sequences come out as U+FFFD, unknown ids as nothing."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    def to_json(self) -> str:
        """tokenizer.json as this tokenizer holds it (with the added tokens of tokenizer_config.json)."""
        return self._backend.to_str()

    def added_tokens(self) -> dict[str, int]:
        """The added tokens (special or not, e.g. Qwen3's `<tool_call>`): their text -> their id."""
        return {t.content: i for i, t in self._backend.get_added_tokens_decoder().items() if t.content}

    def tool_call_form(self) -> str | None:
        """How the chat template for tools writes a call: "xml" (`<function=NAME>`, Qwen3-Coder), "json"
        (`<tool_call>` JSON, Qwen3), or None when it writes neither (or the model has no chat template)."""
        try:
            text = self._pick_template([]).text
        except ChatTemplateError:
            return None
        if "<function=" in text:
            return "xml"
        return "json" if "<tool_call>" in text else None

    def decode_stream(self, skip_special_tokens: bool = False, prompt_ids: Iterable[int] = ()) -> StreamDecoder:
        """A decoder for generated ids one at a time; see StreamDecoder."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)

    # -- chat -----------------------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template's text (None when the model has none)."""
        t = self._chat_templates.get("default")
        return t.text if t is not None else None

    @property
    def chat_template_names(self) -> list[str]:
        return sorted(self._chat_templates)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, exactly as transformers' `apply_chat_template(..., tokenize=False)`.

        Extra keyword arguments (e.g. `enable_thinking=False`) become template variables and override the special
        token variables (bos_token, eos_token, ...) of the same name.
        """
        template = self._pick_template(tools)
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation; give a message")
        variables = {
            **self._special_tokens,
            **_plain(template_kwargs),
            "messages": _alias_reasoning_fields(_plain(_normalize_messages(messages))),
            "tools": _plain(_check_tools(tools)),
            "documents": _plain(_check_documents(documents)),
            "add_generation_prompt": add_generation_prompt,
        }
        compiled = self._compile(template)
        try:
            return compiled.render(**variables)
        except _TemplateRaised as exc:
            reason = f"the chat template in {template.source} rejected the conversation: {exc}"
            raise ChatTemplateError(reason) from None
        except Exception as exc:
            # Anything raised while rendering comes from the template meeting this input (a missing key, a sandbox
            # violation, a type mismatch), so report it as a template failure with the template line where we can.
            raise ChatTemplateError(_render_failure_message(template, exc)) from exc

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        special_tokens_in_messages: bool = False,
        **template_kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The chat prompt's text and token ids. Only the template's own markers become special tokens: special-token
        text inside the messages, the tools or the template arguments (a user typing `<|im_start|>assistant`) is read
        as the text it is, so a user cannot forge turns. special_tokens_in_messages=True (trusted deployments) parses
        it as control tokens, as transformers' apply_chat_template(tokenize=True) does."""
        pattern, as_text = self._specials()
        args = {"messages": messages, "tools": tools, **template_kwargs}
        if special_tokens_in_messages or pattern is None or not _any_string(args, pattern.search):
            text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                            **template_kwargs)
            return text, self.encode(text)
        # each special token's text in the inputs becomes a marker that no input holds; the rendered prompt is then
        # encoded in pieces: the template's text with its markers parsed, each marker as its token's plain text
        mark = next(m for m in (chr(c) for c in range(0xE000, 0xF900)) if not _any_string(args, lambda s: m in s))
        names = sorted(as_text)
        index = {name: i for i, name in enumerate(names)}
        args = _map_strings(args, lambda s: pattern.sub(lambda m: f"{mark}{index[m.group()]}{mark}", s))
        rendered = self.apply_chat_template(args.pop("messages"), add_generation_prompt=add_generation_prompt,
                                            tools=args.pop("tools"), **args)
        pieces = re.split(f"{mark}(\\d+){mark}", rendered)
        ids, text = [], []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += as_text[names[int(piece)]]
                text.append(names[int(piece)])
            elif piece:
                ids += self.encode(piece)
                text.append(piece)
        return "".join(text), ids

    def _pick_template(self, tools: list[dict] | None) -> _ChatTemplate:
        # Same choice as transformers: "tool_use" when tools are given and it exists, else "default".
        templates = self._chat_templates
        if not templates:
            raise ChatTemplateError(
                f"the model at {self.source} has no chat template (looked for chat_template in "
                f"{TOKENIZER_CONFIG_FILE}, {CHAT_TEMPLATE_FILE} and {CHAT_TEMPLATE_DIR}/*.jinja)"
            )
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ChatTemplateError(
            f"the model at {self.source} has several chat templates and none is named 'default'; "
            f"available: {', '.join(sorted(templates))}"
        )

    def _compile(self, template: _ChatTemplate) -> jinja2.Template:
        # Compiled lazily, so a model whose template does not compile can still be used for plain completion.
        compiled = self._compiled.get(template.text)
        if compiled is None:
            try:
                compiled = _chat_environment().from_string(template.text)
            except jinja2.exceptions.TemplateSyntaxError as exc:
                raise ChatTemplateError(
                    f"the chat template in {template.source} does not compile: {exc.message} "
                    f"(template line {exc.lineno})"
                ) from None
            self._compiled[template.text] = compiled
        return compiled


class StreamDecoder:
    """Turns generated token ids, pushed one at a time, into text that only ever contains complete characters.

    Byte-level tokenizers split a multi-byte UTF-8 character over several tokens, and decoding a lone piece gives
    U+FFFD. So the decoder keeps the ids since the last emitted text and only emits once their decoding no longer ends
    in an incomplete character. It decodes a window that starts a little before the new ids, because some decoders
    (SentencePiece-style leading spaces) render a token differently at the very start of a text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, prompt_ids: Iterable[int] = ()):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids]
        # The prompt only serves as decoding context: its last few ids start the window, none of it is emitted.
        self._read = len(self._ids)
        self._prefix = max(self._read - 5, 0)
        self._prefix_text = self._decode(self._prefix, self._read)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ('' while a character is still incomplete)."""
        self._ids.append(int(token_id))
        text = self._decode(self._prefix, len(self._ids))
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character comes out as U+FFFD), at end of generation."""
        text = self._decode(self._prefix, len(self._ids))
        if len(text) <= len(self._prefix_text):
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        new_text = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        return new_text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)


def _any_string(value: Any, test) -> bool:
    """True when test(s) holds for some string inside value (dicts, lists and tuples are searched)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if test(v):
                return True
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return False


def _map_strings(value: Any, fn) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc keeps them otherwise: a 16 MB prompt's encoding left
    ~1.6 GB held after the request)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


# -- loading ----------------------------------------------------------------------------------------------------------


def _load_backend(path: Path) -> _Backend:
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: Strata needs the Hugging Face fast-tokenizer file {TOKENIZER_FILE}")
    try:
        backend = _Backend.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception for every parse problem
        raise ModelLoadError(f"{path} is not a valid {TOKENIZER_FILE}: {exc}") from None
    # Some tokenizer.json files carry training-time truncation/padding; applied here they would silently cut prompts.
    backend.no_truncation()
    backend.no_padding()
    return backend


def _read_json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as plain strings or as serialized AddedToken dicts.
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_special_tokens(config: dict, config_path: Path) -> dict[str, str]:
    tokens = {}
    for name in _NAMED_SPECIAL_TOKENS:
        value = config.get(name)
        if value is None:
            continue
        content = _token_content(value)
        if content is None:
            raise ModelLoadError(f"{config_path}: {name} must be a string or an object with 'content', got {value!r}")
        tokens[name] = content
    return tokens


def _add_missing_added_tokens(backend: _Backend, entries: Mapping[str, Any], config_path: Path) -> None:
    """Add tokens that tokenizer_config.json's added_tokens_decoder declares but tokenizer.json lacks.

    tokenizer.json wins where both name an id (it is what transformers' fast tokenizer encodes with); a missing token
    can only be appended at the next free id, so any other id means the two files disagree about the vocabulary.
    """
    for key, entry in sorted(entries.items(), key=lambda item: int(item[0])):
        token_id, content = int(key), _token_content(entry)
        if content is None or backend.id_to_token(token_id) is not None or backend.token_to_id(content) is not None:
            continue
        next_id = backend.get_vocab_size(with_added_tokens=True)
        if token_id != next_id:
            raise ModelLoadError(
                f"{config_path}: added_tokens_decoder declares {content!r} at id {token_id}, which {TOKENIZER_FILE} "
                f"neither has nor can append (its next free id is {next_id})"
            )
        flags = {flag: bool(entry[flag]) for flag in ("single_word", "lstrip", "rstrip", "normalized") if flag in entry}
        token = AddedToken(content, special=bool(entry.get("special", False)), **flags)
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


def _eos_token_ids(path: Path, backend: _Backend, eos_token: str | None, config_path: Path) -> list[int]:
    """Every id that ends generation: the tokenizer's eos token, then generation_config.json's, then config.json's."""
    ids: list[int] = []
    if eos_token is not None:
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise ModelLoadError(f"{config_path}: eos_token {eos_token!r} is not in the vocabulary of {TOKENIZER_FILE}")
        ids.append(eos_id)
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            ids.extend(_eos_ids_from_config(file))
    return list(dict.fromkeys(ids))  # dedupe, keeping the tokenizer's own eos first


def _eos_ids_from_config(file: Path) -> list[int]:
    value = _read_json_object(file).get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{file}: eos_token_id must be a token id or a list of token ids, got {value!r}")
    return values


def _load_chat_templates(path: Path, config: dict, config_path: Path) -> dict[str, _ChatTemplate]:
    # As in transformers: standalone .jinja files, when there are any, replace the templates in tokenizer_config.json.
    files = {}
    if (path / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = path / CHAT_TEMPLATE_FILE
    if (path / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((path / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            files[file.name.removesuffix(".jinja")] = file
    if files:
        return {name: _ChatTemplate(_read_text(file), str(file)) for name, file in files.items()}
    return _config_chat_templates(config.get("chat_template"), config_path)


def _config_chat_templates(value: Any, config_path: Path) -> dict[str, _ChatTemplate]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": _ChatTemplate(value, str(config_path))}
    if isinstance(value, list) and all(isinstance(t, Mapping) and {"name", "template"} <= t.keys() for t in value):
        return {t["name"]: _ChatTemplate(t["template"], f"{config_path} (template {t['name']!r})") for t in value}
    raise ModelLoadError(
        f"{config_path}: chat_template must be a string or a list of {{name, template}} objects, got {value!r:.200}"
    )


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from None


# -- the jinja environment, mirroring transformers.utils.chat_template_utils -------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering passes it through.

    Without it templates that use the tag (transformers supports it) would not even compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateDict:
    """`dict(...)` for templates without exposing the real type (whose attributes allow type hackery)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, which could reach CPython internals."""

    def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace, so `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attribute {name!r}")


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters (<, >, &, ') which would change the prompt; transformers' doesn't.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < _MIN_JINJA:
        raise ChatTemplateError(
            f"chat templates need jinja2>=3.1.6 (older versions have sandbox escapes); found {jinja2.__version__}"
        )
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _render_failure_message(template: _ChatTemplate, exc: Exception) -> str:
    where = f" at template line {line}" if (line := _template_line(exc)) is not None else ""
    return f"the chat template in {template.source} failed{where}: {type(exc).__name__}: {exc}"


def _template_line(exc: BaseException) -> int | None:
    # jinja rewrites tracebacks so template code shows up as frames of a file named "<template>" at template lines.
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


# -- template inputs, prepared as transformers prepares them ----------------------------------------------------------


def _normalize_messages(messages: list) -> list[dict]:
    # Drop keys whose value is None: APIs send content=None next to tool_calls, and templates handle a missing key
    # but render a literal "None" (or crash) on a None one.
    normalized = []
    for message in messages:
        message = _message_to_dict(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be dicts with 'role' and 'content', got {message!r:.200}")
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def _message_to_dict(message: Any) -> Any:
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return {field.name: getattr(message, field.name) for field in dataclasses.fields(message)}
    if callable(getattr(message, "model_dump", None)):  # pydantic models, e.g. OpenAI SDK messages
        return message.model_dump()
    return message


def _plain(value: Any) -> Any:
    """A copy of `value` made only of JSON types, so the sandboxed template never sees a caller object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) carry extra methods; keep only the base value
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if _is_numpy_scalar(value):  # np.bool_(False) would otherwise become a truthy placeholder
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    # Templates only test whether media keys are present, so an inert placeholder renders the same.
    return f"<{type(value).__name__}>"


def _is_numpy_scalar(value: Any) -> bool:
    numpy = sys.modules.get("numpy")  # if numpy was never imported, the value cannot be a numpy scalar
    return numpy is not None and isinstance(value, numpy.generic)


def _alias_reasoning_fields(messages: list[dict]) -> list[dict]:
    # Callers name a message's reasoning differently; templates read `reasoning_content` (and gpt-oss `thinking`).
    aliased = []
    for message in messages:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _check_tools(tools: list | None) -> list | None:
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(f"tools must be JSON-schema dicts, got {type(tool).__name__}: {tool!r:.200}")
    return tools


def _check_documents(documents: list | None) -> list | None:
    if documents is not None:
        for document in documents:
            if not isinstance(document, Mapping):
                raise ChatTemplateError(f"documents must be dicts with 'title' and 'text', got {document!r:.200}")
    return documents
