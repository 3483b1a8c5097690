"""Chat turns with tool calls: a conversation -> the model's own template -> tokens; the reply ->
text and validated tool calls. ROS-free, like the rest of the engine.

Parts (lower ones never import higher ones):

====================  ==========================================================================
``conversation.py``   messages, tools, tool_choice: plain data, checked where made
``syntax.py``         how calls are written: Gemma 4's native calls, JSON in ``<tool_call>`` tags;
                      each syntax's grammar (Lark for llguidance) and parser
``template.py``       the Jinja template in a sandbox; tokens without forged turns; the fallback
                      for templates without tools
``reply.py``          generated tokens -> streamed text -> the assistant message, calls validated
``turn.py``           one turn made ready: tokens, syntax, constraint
====================  ==========================================================================
"""
from .conversation import (ChatMessage, Conversation, Tool, ToolCall, conversation_from_json,
                           parse_tools)
from .reply import AssistantReply, ReplyStream
from .syntax import GEMMA_CALLS, TAGGED_JSON_CALLS, CallSyntax
from .template import ChatTemplate, ChatVocab, TemplateError
from .turn import ChatTurn, model_template, prepare_turn

__all__ = ["AssistantReply", "CallSyntax", "ChatMessage", "ChatTemplate", "ChatTurn", "ChatVocab",
           "Conversation", "GEMMA_CALLS", "ReplyStream", "TAGGED_JSON_CALLS", "TemplateError", "Tool",
           "ToolCall", "conversation_from_json", "model_template", "parse_tools", "prepare_turn"]
