"""Tiny random-weight GGUFs that carry a chat template (``tokenizer.chat_template``), for chat tests.

    path = write_tiny_chat_gguf(tmp_path / "chat.gguf")                       # Gemma 4 style, tools
    path = write_tiny_chat_gguf(tmp_path / "g3.gguf", template=GEMMA3_STYLE)  # Gemma 3 style, no tools

The embedded Gemma 3 270M is a base model without a chat template, and no instruction-tuned Gemma
can be had here, so these files carry templates written for the tests in the formats of the two
families (the formats are facts about the models; the template text is this project's own):

- :data:`GEMMA4_STYLE`: Gemma 4's turns (``<|turn>role`` ... ``<turn|>``), tool declarations in
  the system turn (``<|tool>declaration:NAME{...}<tool|>``), native calls
  (``<|tool_call>call:NAME{key:value,...}<tool_call|>``, strings between ``<|"|>`` tokens, keys in
  sorted order) and tool responses inside the model's turn (the ``tool_responses`` of an assistant
  message, as Gemma 4's own template takes them).
- :data:`GEMMA3_STYLE`: Gemma 3's turns (``<start_of_turn>user`` ... ``<end_of_turn>``), the system
  text prepended to the first user turn, roles that must alternate, no tools: the chat layer's
  fallback describes the tools in a system message instead.

The vocabulary is :mod:`tiny_gguf`'s (byte-level BPE, one token per character) with the two
families' turn and tool markers added as control tokens (:data:`CONTROL_TOKENS`); the end of a turn
is the end-of-turn token (``<turn|>``, ``<end_of_turn>``) besides ``</s>``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Tuple

import gguf
import numpy as np

from support.tiny_gguf import (BOS_ID, EOS_ID, UNK_ID, PathLike, _random_weights, finish_file,
                               tiny_vocab)

#: Control tokens of the two template styles, after tiny_vocab's ordinary tokens.
GEMMA4_TOKENS: Tuple[str, ...] = ("<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                                  "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>')
GEMMA3_TOKENS: Tuple[str, ...] = ("<start_of_turn>", "<end_of_turn>")
CONTROL_TOKENS: Tuple[str, ...] = GEMMA4_TOKENS + GEMMA3_TOKENS
VOCAB_SIZE = 128
N_EMBD = 32

GEMMA4_STYLE = r"""
{%- macro value(v) -%}
    {%- if v is string -%}{{- '<|"|>' + v + '<|"|>' -}}
    {%- elif v is boolean -%}{{- 'true' if v else 'false' -}}
    {%- elif v is mapping -%}
        {{- '{' -}}
        {%- for key, item in v | dictsort -%}{{- key + ':' + value(item) -}}{{- ',' if not loop.last -}}{%- endfor -%}
        {{- '}' -}}
    {%- elif v is sequence -%}
        {{- '[' -}}{%- for item in v -%}{{- value(item) -}}{{- ',' if not loop.last -}}{%- endfor -%}{{- ']' -}}
    {%- elif v is none -%}{{- 'null' -}}
    {%- else -%}{{- v -}}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(rest=messages, previous='') -%}
{%- if tools or messages[0]['role'] == 'system' -%}
    {{- '<|turn>system\n' -}}
    {%- if messages[0]['role'] == 'system' -%}
        {{- messages[0]['content'] | trim -}}
        {%- set ns.rest = messages[1:] -%}
    {%- endif -%}
    {%- for tool in tools or [] -%}
        {{- '<|tool>declaration:' + tool['function']['name'] + '{description:<|"|>' -}}
        {{- tool['function']['description'] or '' -}}
        {{- '<|"|>,parameters:' + value(tool['function']['parameters'] or {}) + '}<tool|>' -}}
    {%- endfor -%}
    {{- '<turn|>\n' -}}
{%- endif -%}
{%- for message in ns.rest -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {%- if not (ns.previous == 'tool_response' and message['tool_calls']) -%}
        {{- '<|turn>' + role + '\n' -}}
    {%- endif -%}
    {%- set ns.previous = '' -%}
    {%- for call in message['tool_calls'] or [] -%}
        {{- '<|tool_call>call:' + call['function']['name'] + '{' -}}
        {%- for key, item in call['function']['arguments'] | dictsort -%}
            {{- key + ':' + value(item) -}}{{- ',' if not loop.last -}}
        {%- endfor -%}
        {{- '}<tool_call|>' -}}
    {%- endfor -%}
    {%- for response in message['tool_responses'] or [] -%}
        {{- '<|tool_response>response:' + response['name'] + '{value:' + value(response['response']) -}}
        {{- '}<tool_response|>' -}}
        {%- set ns.previous = 'tool_response' -%}
    {%- endfor -%}
    {%- if message['content'] -%}{{- message['content'] | trim -}}{%- endif -%}
    {%- if not (message['tool_responses'] and not message['content']) -%}{{- '<turn|>\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.previous != 'tool_response' -%}{{- '<|turn>model\n' -}}{%- endif -%}
"""

GEMMA3_STYLE = r"""
{{- bos_token -}}
{%- set ns = namespace(rest=messages, system='') -%}
{%- if messages[0]['role'] == 'system' -%}
    {%- set ns.system = (messages[0]['content'] | trim) + '\n\n' -%}
    {%- set ns.rest = messages[1:] -%}
{%- endif -%}
{%- for message in ns.rest -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' + role + '\n' + (ns.system if loop.first else '') -}}
    {{- (message['content'] | trim) + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""


def chat_vocab() -> Tuple[List[str], List[int]]:
    """Token texts and types: tiny_vocab's ordinary tokens, then :data:`CONTROL_TOKENS`."""
    tokens = tiny_vocab(VOCAB_SIZE)
    first = len([t for t in tokens if not t.startswith("<tok")])
    tokens = tokens[:first] + list(CONTROL_TOKENS)
    tokens += [f"<tok{i}>" for i in range(len(tokens), VOCAB_SIZE)]
    types = [gguf.TokenType.NORMAL] * VOCAB_SIZE
    types[UNK_ID] = gguf.TokenType.UNKNOWN
    for i in (BOS_ID, EOS_ID, *range(first, first + len(CONTROL_TOKENS))):
        types[i] = gguf.TokenType.CONTROL
    return tokens, types


def token_id(text: str) -> int:
    """The id of a token of :func:`chat_vocab` by its text."""
    return chat_vocab()[0].index(text)


def write_tiny_chat_gguf(path: PathLike, template: str = GEMMA4_STYLE, seed: int = 0,
                         n_layer: int = 1, arch: str = "llama", sliding_window: int = 0) -> Path:
    """A random-weight F32 model with :func:`chat_vocab` and ``template`` as its
    ``tokenizer.chat_template``; the end-of-turn token of the template's style is its EOT token.
    ``arch`` ``gemma3`` gives it Gemma 3's sliding-window layers (5 of every 6), which see the last
    ``sliding_window`` positions (0: all of them)."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    tensors: Dict[str, np.ndarray] = _random_weights(VOCAB_SIZE, N_EMBD, 2 * N_EMBD, n_layer, arch, rng)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, arch)
    writer.add_name(f"tiny-chat-s{seed}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_context_length(4096)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(2 * N_EMBD)
    writer.add_head_count(N_EMBD // 8)
    writer.add_head_count_kv(N_EMBD // 8)
    writer.add_key_length(8)
    writer.add_value_length(8)
    writer.add_rope_dimension_count(8)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        writer.add_sliding_window(sliding_window or 4096)
    tokens, types = chat_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["a b"])  # llama.cpp requires merges; see tiny_gguf
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_eot_token_id(tokens.index("<turn|>" if "<|turn>" in template else "<end_of_turn>"))
    writer.add_chat_template(template)
    return finish_file(writer, tensors, partial, path)
