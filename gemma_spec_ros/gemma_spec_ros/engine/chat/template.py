"""The model's own chat template (GGUF ``tokenizer.chat_template``), rendered and tokenized safely.

Rendering: Jinja2 in :class:`jinja2.sandbox.ImmutableSandboxedEnvironment` (what llama-cpp-python and
transformers use: a template cannot reach Python's internals nor change its inputs), with the
environment those templates expect: ``trim_blocks`` / ``lstrip_blocks``, the loop-controls extension,
``tojson`` as :func:`json.dumps` without ASCII escapes, ``raise_exception`` and ``strftime_now``,
and the variables ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``.
A template that does not compile or raises while rendering is refused with Jinja's reason.

Tokenizing without forged turns. The turn markers a template writes (``<start_of_turn>``,
``<|turn>``, ``<|tool_call>``...) are control tokens, parsed from the template's own text; the
clients' text (message contents, a call's string arguments, tool descriptions) must stay text: a
user who writes ``<end_of_turn><start_of_turn>model`` gets those characters, not a new turn. So the
template is rendered twice: once with every such text replaced by a *slot* (a private-use marker,
:class:`Slots`), once with the texts themselves. The slotted rendering is the template's text: it is
split at control tokens; each slot is then filled with the text as the real rendering shows it
(as given, trimmed, or JSON-escaped by ``tojson``), and the text between two control tokens is
tokenized as plain text. A template that changes a text otherwise (cuts it, upper-cases it) cannot
be told apart from its own markup: refused. Strings a template inspects or sorts (tool names,
schema keys and types, a call's argument keys, names and ids) are rendered as they are, and a
request where one of them contains a control token's text is refused.

Tools, as the template expects them: a template that takes ``tools`` and writes a call syntax this
package parses (:mod:`.syntax`: Gemma 4's ``<|tool_call>``, or JSON in ``<tool_call>`` tags) gets
the tools and the calls in OpenAI's shape (a call's arguments as an object); tool results become
``tool_responses`` of the assistant message they answer where the template reads those (Gemma 4),
else tool messages. Any other template gets the **fallback** (:func:`fallback_messages`): a system
message describing the tools (their JSON Schemas) and the call syntax, earlier calls written into
the assistant's text in that syntax, tool results as user messages, consecutive messages of one
role joined (templates such as Gemma 3's require alternating roles).
"""
from __future__ import annotations

import ctypes
import datetime
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .conversation import ChatMessage, Conversation, Tool
from .syntax import GEMMA_CALLS, TAGGED_JSON_CALLS, CallSyntax, syntax_of_template
from ..llama.chat_prompt import split_at_control_tokens, tokens_of_parts
from ..llama.special_texts import SpecialTexts

#: A slot: a private-use character, the slot's number, another one (no template writes these, no
#: vocabulary parses them as a control token, and trim, upper and JSON escaping leave them alone).
SLOT_OPEN, SLOT_CLOSE = "\ue000", "\ue001"
SLOT = re.compile(f"{SLOT_OPEN}([0-9]+){SLOT_CLOSE}")
#: Characters of a template's error message quoted in a refusal.
MAX_REASON = 300

Part = Union[str, int]  # text, or a control token's id


class TemplateError(ValueError):
    """The chat template cannot serve this conversation (it does not compile, it raised, or it
    changes the clients' text); the message says why."""


class ChatVocab:
    """What the chat layer asks of a model's vocabulary, over a loaded
    :class:`~gemma_spec_ros.engine.llama.model.LlamaModel`: plain tokenization, the control tokens a
    text spells, and each generated token's text (control tokens apart)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.bos, self.eos = backend.bos, backend.eos
        #: the vocabulary's special texts, split in one scan of a text (None: llama.cpp's parsing)
        self._special = SpecialTexts.of(backend)

    def token_text(self, token: int) -> str:
        return self._backend.token_text(token).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return self._backend.token_bytes(token)

    def is_control(self, token: int) -> bool:
        """A control token (a marker: kept apart from text; ``<unk>`` is text, as the grammar sees it)."""
        return self._backend.is_control(token)

    def is_eog(self, token: int) -> bool:
        return self._backend.is_eog(token)

    def control_id(self, text: str) -> Optional[int]:
        """The control token whose text is ``text``, None if the vocabulary has none."""
        tokens = self._backend.tokenize(text, add_special=False, parse_special=True)
        if len(tokens) == 1 and self.is_control(tokens[0]):
            return tokens[0]
        return None

    def split(self, text: str) -> List[Part]:
        """``text`` split at the control tokens llama.cpp's special-token parsing finds in it (in
        one scan of the text: llama.cpp's own parsing scans it once per special token)."""
        if self._special is not None:
            return self._special.split(text)
        return split_at_control_tokens(self._backend, text)

    def tokens(self, parts: Sequence[Part]) -> List[int]:
        """Control ids as they are, the text between them tokenized as plain text; BOS added as the
        model wants it, once (a template that writes ``bos_token`` itself has written it)."""
        tokens = tokens_of_parts(self._backend, parts)
        if self._backend.add_bos and tokens[:2] == [self.bos, self.bos]:
            tokens = tokens[1:]
        return tokens


class Slots:
    """Clients' texts set aside while the template renders: :meth:`put` returns the marker the
    template sees (empty text stays empty: nothing to protect, and ``if content`` stays false)."""

    def __init__(self) -> None:
        self.texts: List[str] = []

    def put(self, text: str) -> str:
        if not text:
            return text
        self.texts.append(text)
        return f"{SLOT_OPEN}{len(self.texts) - 1}{SLOT_CLOSE}"


@dataclass
class TemplateView:
    """A conversation as the template gets it, twice: ``slotted`` (clients' texts as slots) and
    ``real``; ``unslotted``: every other client string that reaches the template, by where it is
    (checked for control-token text)."""

    slotted: Dict[str, Any]
    real: Dict[str, Any]
    slots: Slots
    unslotted: List[Tuple[str, str]] = field(default_factory=list)


class ChatTemplate:
    """One chat template, compiled once; see the module docstring."""

    def __init__(self, source: str, origin: str = "the model's chat template") -> None:
        import jinja2  # noqa: WPS433
        import jinja2.ext  # noqa: WPS433
        import jinja2.meta  # noqa: WPS433
        import jinja2.sandbox  # noqa: WPS433

        self.source, self.origin = source, origin
        env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateError as exc:
            raise TemplateError(f"{origin} does not compile: {_short(exc)}") from None
        takes_tools = "tools" in variables
        #: the template renders the conversation's messages (a text without them is no chat template)
        self.reads_messages = "messages" in variables
        self._errors: Tuple[type, ...] = (jinja2.TemplateError,)
        #: the call syntax the template itself writes; None: the fallback describes the tools
        self.native_syntax: Optional[CallSyntax] = syntax_of_template(source) if takes_tools else None
        #: tool results go into the answered assistant message (Gemma 4), not into tool messages
        self.takes_tool_responses = "tool_responses" in source

    @property
    def call_syntax(self) -> CallSyntax:
        """The syntax calls are written and parsed in: the template's own, or the fallback's."""
        return self.native_syntax or TAGGED_JSON_CALLS

    def render(self, view: Mapping[str, Any], bos_token: str = "", eos_token: str = "") -> str:
        """The template's text for ``view`` (messages and tools), with the generation prompt.

        Bounded (it runs in a goal callback, and a template file is a program): at most
        :data:`RENDER_SECONDS` and :data:`MAX_RENDER_CHARS` of output, ``range`` and repeated
        strings within :data:`MAX_RENDER_ITEMS` items a render (:class:`_BoundedEnvironment`)."""
        try:
            with _Deadline(RENDER_SECONDS):
                return self._render(view, bos_token, eos_token)
        except TemplateError:  # raise_exception, a bound: the template's own words, or ours
            raise
        except self._errors as exc:
            raise TemplateError(f"{self.origin} failed to render this conversation: {_short(exc)}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError,
                RecursionError) as exc:
            raise TemplateError(f"{self.origin} failed to render this conversation: "
                                f"{type(exc).__name__}: {_short(exc)}") from None

    def _render(self, view: Mapping[str, Any], bos_token: str, eos_token: str) -> str:
        pieces: List[str] = []
        size = 0
        environment = self._template.environment
        environment.budget = MAX_RENDER_ITEMS  # type: ignore[attr-defined]
        for piece in self._template.generate(messages=view["messages"], tools=view["tools"],
                                             add_generation_prompt=True, bos_token=bos_token,
                                             eos_token=eos_token):
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise TemplateError(f"{self.origin} renders more than {MAX_RENDER_CHARS} characters "
                                    "for this conversation")
            pieces.append(piece)
        return "".join(pieces)

    def view(self, conversation: Conversation) -> TemplateView:
        """The conversation in the shape this template expects (see the module docstring)."""
        view = TemplateView({}, {}, Slots())
        native = self.native_syntax is not None
        messages = conversation.messages if native else fallback_messages(conversation, self.call_syntax)
        tools = conversation.shown if native else ()
        for key, shape in (("slotted", view.slots.put), ("real", _as_is)):
            unslotted = view.unslotted if key == "slotted" else []
            rendered = [_message_dict(m, i, shape, unslotted) for i, m in enumerate(messages)]
            if self.takes_tool_responses:
                rendered = _fold_tool_responses(rendered, messages)
            tool_dicts = [_tool_dict(tool, shape, unslotted) for tool in tools] or None
            setattr(view, key, {"messages": rendered, "tools": tool_dicts})
        return view

    def prompt_tokens(self, conversation: Conversation, vocab: ChatVocab) -> Tuple[List[int], str]:
        """The conversation's prompt tokens and its rendered text; TemplateError with the reason."""
        view = self.view(conversation)
        _check_unslotted(view.unslotted, vocab)
        bos, eos = vocab.token_text(vocab.bos), vocab.token_text(vocab.eos)
        slotted = self.render(view.slotted, bos, eos)
        real = self.render(view.real, bos, eos)
        shown = iter(align(slotted, real, view.slots.texts, self.origin))
        # one pass of llama.cpp's special-token parsing over the template's text: a slot holds no
        # control token's text, so the slots split nothing, and each then takes its text back
        parts = [SLOT.sub(lambda _: next(shown), part) if isinstance(part, str) else part
                 for part in vocab.split(slotted)]
        return vocab.tokens(parts), real


def _as_is(text: str) -> str:
    return text


def _message_dict(message: ChatMessage, index: int, shape: Callable[[str], str],
                  unslotted: List[Tuple[str, str]]) -> Dict[str, Any]:
    """One message in OpenAI's shape (a call's arguments as an object), the clients' texts through
    ``shape``; names and ids noted in ``unslotted``."""
    entry: Dict[str, Any] = {"role": message.role, "content": shape(message.content)}
    where = f"messages[{index}]"
    if message.name:
        entry["name"] = message.name
        unslotted.append((f"{where}.name", message.name))
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
        unslotted.append((f"{where}.tool_call_id", message.tool_call_id))
    if message.tool_calls:
        entry["tool_calls"] = []
        for call in message.tool_calls:
            unslotted.append((f"{where}.tool_calls id", call.id))
            arguments = _shape_strings(call.arguments_object, shape, unslotted, f"{where}.{call.name} arguments")
            entry["tool_calls"].append({"id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": arguments}})
    return entry


def _shape_strings(value: Any, shape: Callable[[str], str], unslotted: List[Tuple[str, str]],
                   where: str) -> Any:
    """``value`` with its string values through ``shape``; its keys noted in ``unslotted``."""
    if isinstance(value, str):
        return shape(value)
    if isinstance(value, list):
        return [_shape_strings(item, shape, unslotted, where) for item in value]
    if isinstance(value, dict):
        unslotted.extend((f"{where} key", key) for key in value)
        return {key: _shape_strings(item, shape, unslotted, where) for key, item in value.items()}
    return value


def _tool_dict(tool: Tool, shape: Callable[[str], str], unslotted: List[Tuple[str, str]]) -> Dict[str, Any]:
    """A tool in OpenAI's shape, its descriptions through ``shape`` (free text); every other string
    of its schema (keys, types, enum values) noted in ``unslotted``: templates inspect and sort them."""
    where = f"tool {tool.name!r}"

    def walk(value: Any, key: str = "") -> Any:
        if isinstance(value, str):
            if key == "description":
                return shape(value)
            unslotted.append((where, value))
            return value
        if isinstance(value, list):
            return [walk(item) for item in value]
        if isinstance(value, dict):
            unslotted.extend((where, k) for k in value)
            return {k: walk(item, k) for k, item in value.items()}
        return value

    return {"type": "function", "function": {"name": tool.name, "description": shape(tool.description),
                                             "parameters": walk(dict(tool.parameters))}}


def _fold_tool_responses(rendered: List[Dict[str, Any]], messages: Sequence[ChatMessage]) -> List[Dict[str, Any]]:
    """Tool messages moved into the assistant message whose call they answer, as its
    ``tool_responses`` (``{"name": tool, "response": content}``): Gemma 4's shape."""
    names = {call.id: call.name for m in messages for call in m.tool_calls}
    out: List[Dict[str, Any]] = []
    for entry, message in zip(rendered, messages):
        if message.role != "tool":
            out.append(entry)
            continue
        answered = next(e for e in reversed(out) if any(c["id"] == message.tool_call_id
                                                        for c in e.get("tool_calls", ())))
        answered.setdefault("tool_responses", []).append(
            {"name": message.name or names[message.tool_call_id], "response": entry["content"]})
    return out


def fallback_messages(conversation: Conversation, syntax: CallSyntax) -> Tuple[ChatMessage, ...]:
    """The conversation for a template without tool support: the tools described in a system
    message (:meth:`CallSyntax.describe`), calls written into the assistant's text, tool results
    as user messages, and consecutive messages of one role joined by a blank line."""
    messages: List[ChatMessage] = []
    tools = conversation.shown
    if tools:  # the same text every turn (the grammar holds the reply to tool_choice): a stable prefix
        messages.append(ChatMessage("system", syntax.describe(tools, conversation.parallel_tool_calls)))
    for message in conversation.messages:
        if message.role == "tool":
            messages.append(ChatMessage("user", syntax.describe_result(
                message.name or _called(conversation, message.tool_call_id), message.content)))
        elif message.tool_calls:
            calls = "\n".join(syntax.write(call.name, call.arguments_object) for call in message.tool_calls)
            messages.append(ChatMessage("assistant", "\n".join(t for t in (message.content, calls) if t)))
        else:
            messages.append(ChatMessage(message.role, message.content))
    joined: List[ChatMessage] = []
    for message in messages:
        if joined and joined[-1].role == message.role:
            joined[-1] = ChatMessage(message.role, joined[-1].content + "\n\n" + message.content)
        else:
            joined.append(message)
    return tuple(joined)


def _called(conversation: Conversation, call_id: str) -> str:
    return next(call.name for m in conversation.messages for call in m.tool_calls if call.id == call_id)


def _check_unslotted(strings: Sequence[Tuple[str, str]], vocab: ChatVocab) -> None:
    """TemplateError if a string the template renders as it is spells a control token."""
    for where, text in strings:
        for part in vocab.split(text):
            if isinstance(part, int):
                raise TemplateError(f"{where} contains {vocab.token_text(part)!r}, a control token of "
                                    "the model's template: refused (it would be read as markup)")


def align(slotted: str, real: str, texts: Sequence[str], origin: str = "the chat template") -> List[str]:
    r"""Each slot of ``slotted``, in order, as the real rendering shows its text: as given, trimmed,
    or JSON-escaped. TemplateError where the real rendering shows a text the template changed
    otherwise, or differs in the template's own text.

    >>> align("<a>\ue0000\ue001</a>", "<a>hi</a>", [" hi"])
    ['hi']
    >>> align('["\ue0000\ue001"]', r'["say \"hi\""]', ['say "hi"'])
    ['say \\"hi\\"']
    """
    pieces = SLOT.split(slotted)  # template text, slot number, template text, ...
    shown: List[str] = []
    at = 0
    for k in range(0, len(pieces), 2):
        own = pieces[k]
        if SLOT_OPEN in own or SLOT_CLOSE in own or not real.startswith(own, at):
            raise TemplateError(f"{origin} changes the messages' text (it cuts or rewrites a message, "
                                "so the clients' text cannot be kept apart from its markup)")
        at += len(own)
        if k + 1 == len(pieces):
            break
        text, following = texts[int(pieces[k + 1])], pieces[k + 2]
        form = next((c for c in _shown_as(text)
                     if real.startswith(c, at) and real.startswith(following, at + len(c))), None)
        if form is None:
            raise TemplateError(f"{origin} changes the text {text[:40]!r} in a way this package "
                                "cannot follow (it keeps, trims or JSON-escapes texts only)")
        shown.append(form)
        at += len(form)
    if at != len(real):
        raise TemplateError(f"{origin} renders differently from one call to the next")
    return shown


def _shown_as(text: str) -> List[str]:
    """How a template may show ``text``: as it is, trimmed, JSON-escaped (with or without ASCII
    escapes), longest first so that a shorter form is not taken for a prefix."""
    forms = [text, text.strip(), json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]]
    unique = list(dict.fromkeys(forms))
    return sorted(unique, key=len, reverse=True)


#: Bounds of one render (ChatTemplate.render): seconds, characters of output, and items that
#: ``range`` and string repetition may make. A chat template renders in milliseconds and writes
#: about the conversation's own size (bounded by limits.max_prompt_bytes, 64 KiB by default).
RENDER_SECONDS = 1.0
MAX_RENDER_CHARS = 4 << 20
MAX_RENDER_ITEMS = 1 << 20


def _bounded_environment_class() -> type:
    """Jinja's immutable sandbox with a budget of items per render: ``range`` (the sandbox allows
    100,000 a call, with no bound on the calls) and ``*`` of strings and lists take theirs from it."""
    import jinja2.sandbox  # noqa: WPS433

    class BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])
        budget = MAX_RENDER_ITEMS

        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self.globals["range"] = self._range

        def _take(self, items: int) -> None:
            self.budget -= max(0, items)
            if self.budget < 0:
                raise TemplateError(f"the chat template makes more than {MAX_RENDER_ITEMS} items "
                                    "(range, repeated strings) in one render")

        def _range(self, *args: int) -> range:
            items = range(*args)
            self._take(len(items))
            return items

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**":
                if isinstance(right, int) and abs(right) > 64:
                    raise TemplateError("the chat template raises a number to a power above 64")
                return left ** right
            if isinstance(left, (str, list, tuple)) and isinstance(right, int):
                self._take(len(left) * right)
            elif isinstance(right, (str, list, tuple)) and isinstance(left, int):
                self._take(len(right) * left)
            return left * right

    return BoundedEnvironment


def _BoundedEnvironment(**options: Any) -> Any:  # noqa: N802  a class made at first use (jinja2 imported late)
    global _BOUNDED_ENVIRONMENT
    if _BOUNDED_ENVIRONMENT is None:
        _BOUNDED_ENVIRONMENT = _bounded_environment_class()
    return _BOUNDED_ENVIRONMENT(**options)


_BOUNDED_ENVIRONMENT: Optional[type] = None


class _Deadline:
    """Raise TemplateError in this thread once ``seconds`` have passed inside the ``with`` block
    (a template's loops are Python bytecode: CPython delivers an exception set for a thread at its
    next instruction). Set only while the block has not ended, and caught by the block's caller."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._open = True
        self._thread_id = threading.get_ident()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def _expire(self) -> None:
        with self._lock:
            if self._open:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id),
                                                           ctypes.py_object(_RenderTimeout))

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._timer.cancel()
            with self._lock:
                self._open = False
        except _RenderTimeout:  # set just before the block ended: the render took the whole time
            pass
        if exc_info[0] is _RenderTimeout:
            raise TemplateError(f"the chat template took more than {self.seconds:g} s to render "
                                "this conversation") from None


class _RenderTimeout(BaseException):
    """Set in a rendering thread by :class:`_Deadline` (a BaseException: no ``except Exception``
    on the way, Jinja's or a filter's, may take it for an error of its own)."""


def _tojson(value: Any, indent: Optional[int] = None, separators: Optional[Tuple[str, str]] = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    """``tojson`` as chat templates expect it (transformers' definition: json.dumps, no HTML escapes)."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= MAX_REASON else text[:MAX_REASON] + " ..."


__all__ = ["ChatTemplate", "ChatVocab", "Slots", "TemplateError", "align", "fallback_messages",
           "GEMMA_CALLS", "TAGGED_JSON_CALLS"]
