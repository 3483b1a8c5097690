"""A LangChain chat model over the node's GenerateChat action, so that LangChain / LangGraph agents
(ROSA-style planners) can plan with the robot's own model, tools and all.

    from gemma_spec_dev.langchain_chat import GemmaSpecChat
    model = GemmaSpecChat(node="/gemma_spec").bind_tools([move_to, pick, say])
    reply = model.invoke([SystemMessage("You plan for a robot."), HumanMessage("Bring the cup.")])
    reply.tool_calls                     # [{"name": "move_to", "args": {...}, "id": ...}], validated
    reply.usage_metadata                 # input / output / total tokens, input_token_details.cache_read
    for chunk in model.stream(history):  # the text as the node streams it; the calls in the last chunk
        ...

An optional extra: ``pip install langchain-core`` (1.x); nothing else in the project imports this
module. The node renders the conversation with the model's own template, constrains the reply to
calls of the bound tools (``tool_choice``: LangChain's ``"any"`` / ``True`` read as required) and
validates each call's arguments against its tool's schema before it comes back; a call that does
not validate is in ``reply.invalid_tool_calls`` with the node's reason. Each turn sends the whole
conversation; the node evaluates only what is new since the conversation's last turn.

Streaming (``stream`` / ``astream``, and ``with_structured_output(...).stream()``): one chunk per
feedback text as the node streams it, then a last chunk (``chunk_position="last"``) with the rest
of the message's text, its calls as ``tool_call_chunks``, the usage and the response metadata; the
chunks add up to the message ``invoke`` returns. (A call the node left out is named in
``response_metadata["error"]``; only ``invoke`` lists it in ``invalid_tool_calls`` too.)

Structured output: ``with_structured_output(schema)`` calls the schema as a tool (required, so the
node's grammar holds the arguments to it); ``method="json_schema"`` constrains the text to the
schema instead (the goal's ``json_schema``), ``method="json_mode"`` to a JSON object.

The wire is one function, ``transport(goal fields) -> result fields`` (plain dicts in the shape of
GenerateChat's goal and result): by default a ROS client of the node
(:func:`ros_transport`: :class:`gemma_spec_ros.client.ChatTransport`); tests and other rigs pass
their own. A transport may also have ``stream(goal fields)`` (an iterator of text pieces, then the
result fields), ``model_name()`` (the served model's name) and ``close()``; without ``stream``
a streamed turn comes as one chunk.
"""
from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import run_in_executor
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

#: goal fields -> result fields (GenerateChat's, as plain dicts)
Transport = Callable[[Dict[str, Any]], Dict[str, Any]]
#: LangChain's message types -> the action's roles
ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}
#: the result's fields in an AIMessage's response_metadata
METADATA = ("finish_reason", "spec_mode", "prompt_tokens", "prompt_tokens_reused", "completion_tokens", "error")
#: finish reasons of a turn that produced no reply of its own
FAILED = ("error", "cancelled", "preempted", "timeout")


def text_of(content: Union[str, Sequence[Any]]) -> str:
    """A message's text: a string, or the text blocks of a list of content blocks."""
    if isinstance(content, str):
        return content
    return "".join(block if isinstance(block, str) else str(block.get("text", ""))
                   for block in content if isinstance(block, (str, dict)))


def chat_message(message: BaseMessage) -> Dict[str, Any]:
    """One LangChain message as a ChatMessage's fields."""
    role = ROLES.get(message.type)
    if role is None:
        raise ValueError(f"a {message.type!r} message has no GenerateChat role (system, human, ai, tool)")
    entry: Dict[str, Any] = {"role": role, "content": text_of(message.content), "name": message.name or "",
                             "tool_call_id": "", "tool_calls": []}
    if isinstance(message, ToolMessage):
        entry["tool_call_id"] = message.tool_call_id
    if isinstance(message, AIMessage):
        entry["tool_calls"] = [{"id": call.get("id") or f"call_{i}", "name": call["name"],
                                "arguments": json.dumps(call.get("args") or {})}
                               for i, call in enumerate(message.tool_calls)]
    return entry


def tool_choice_of(choice: Any) -> str:
    """LangChain's ``tool_choice`` spellings as the action's: ``"any"`` / True -> required, a tool
    dict -> its name, None -> auto.

    >>> [tool_choice_of(c) for c in (None, "any", True, "auto", "move_to", {"function": {"name": "say"}})]
    ['auto', 'required', 'required', 'auto', 'move_to', 'say']
    """
    if choice is None or choice is False:
        return "auto"
    if choice is True or choice == "any":
        return "required"
    if isinstance(choice, dict):
        return str((choice.get("function") or choice).get("name", "auto"))
    return str(choice)


def goal_fields(messages: Sequence[BaseMessage], tools: Sequence[Mapping[str, Any]] = (),
                tool_choice: Any = None, parallel_tool_calls: bool = False,
                stop: Optional[Sequence[str]] = None, **settings: Any) -> Dict[str, Any]:
    """A GenerateChat goal's fields for ``messages``: the conversation, the tools (OpenAI's shape),
    and the sampling / budget settings (``max_tokens``, ``temperature``, ``spec_mode``...)."""
    goal: Dict[str, Any] = {"messages": [chat_message(m) for m in messages],
                            "tools": json.dumps(list(tools)) if tools else "",
                            "tool_choice": tool_choice_of(tool_choice) if tools else "",
                            "parallel_tool_calls": bool(parallel_tool_calls), "stop": list(stop or ())}
    goal.update(settings)
    return goal


def usage_metadata(result: Mapping[str, Any]) -> UsageMetadata:
    """A result's token counts as LangChain's usage metadata: the templated conversation's tokens in,
    the generated ones out, and the conversation's tokens whose KV the node kept as ``cache_read``.

    >>> usage_metadata({"prompt_tokens": 90, "completion_tokens": 12, "prompt_tokens_reused": 80})
    {'input_tokens': 90, 'output_tokens': 12, 'total_tokens': 102, 'input_token_details': {'cache_read': 80}}
    """
    prompt, completion = int(result.get("prompt_tokens") or 0), int(result.get("completion_tokens") or 0)
    return UsageMetadata(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion,
                         input_token_details={"cache_read": int(result.get("prompt_tokens_reused") or 0)})


def response_metadata(result: Mapping[str, Any], model_name: str = "") -> Dict[str, Any]:
    """The result's fields kept in a message's ``response_metadata``, and the model's name."""
    metadata = {key: result.get(key) for key in METADATA}
    if result.get("model_name") or model_name:
        metadata["model_name"] = result.get("model_name") or model_name
    return metadata


def ai_message(result: Mapping[str, Any], model_name: str = "") -> AIMessage:
    """A GenerateChat result's fields as an AIMessage: its text, its calls as LangChain tool calls,
    the node's reason for anything left out as an invalid tool call, and the usage."""
    message = result["message"]
    calls = [tool_call(name=c["name"], args=json.loads(c["arguments"] or "{}"), id=c["id"])
             for c in message.get("tool_calls", [])]
    invalid = [invalid_tool_call(error=result["error"])] if result.get("error") and \
        result.get("finish_reason") in ("stop", "tool_calls", "length") else []
    return AIMessage(content=message.get("content", ""), tool_calls=calls, invalid_tool_calls=invalid,
                     usage_metadata=usage_metadata(result), response_metadata=response_metadata(result, model_name))


def last_chunk(result: Mapping[str, Any], text: str, model_name: str = "") -> AIMessageChunk:
    """A streamed turn's last chunk: the rest of its ``text``, its calls as tool-call chunks (LangChain
    parses them into ``tool_calls`` when the chunks are added up), the usage and the metadata."""
    calls = result["message"].get("tool_calls") or []
    return AIMessageChunk(content=text, tool_call_chunks=[
        tool_call_chunk(name=c["name"], args=c["arguments"] or "{}", id=c["id"], index=i) for i, c in enumerate(calls)],
        usage_metadata=usage_metadata(result), response_metadata=response_metadata(result, model_name),
        chunk_position="last")


class TextStream:
    r"""Streamed text as the final message has it: the node's message is its text stripped, so the
    leading whitespace is dropped and trailing whitespace held until more text follows it; the last
    chunk brings what the message has beyond the text streamed (:meth:`rest`).

    >>> stream = TextStream()
    >>> [stream.push(piece) for piece in ("\n", " Hello", " ", "world", "\n")]
    ['', 'Hello', '', ' world', '']
    >>> stream.rest("Hello world"), stream.rest("Hello world, and more")
    ('', ', and more')
    """

    def __init__(self) -> None:
        self.sent = ""
        self._held = ""

    def push(self, piece: str) -> str:
        """The text of ``piece`` to send now."""
        held = self._held + piece
        if not self.sent:
            held = held.lstrip()
        text = held.rstrip()
        self._held = held[len(text):]
        self.sent += text
        return text

    def rest(self, content: str) -> str:
        """What the message's ``content`` has beyond the text sent ('' if it does not extend it)."""
        return content[len(self.sent):] if content.startswith(self.sent) else ""


def ros_transport(node: str, timeout: float = 300.0) -> Transport:
    """A transport over ROS: a client of the node at ``node`` (rclpy initialised on first use), the
    process's one per node and timeout; closed at exit (or by its ``close()``)."""
    from gemma_spec_ros.client import chat_transport  # noqa: WPS433  imported lazily: it needs rclpy

    return chat_transport(node, timeout)


def whole_turn(transport: Transport, goal: Dict[str, Any]) -> Iterator[Union[str, Dict[str, Any]]]:
    """A turn as a transport without ``stream`` serves it: no text pieces, then the result."""
    yield transport(goal)


class GemmaSpecChat(BaseChatModel):
    """A chat model served by a gemma_spec node (see the module docstring)."""

    node: str = "/gemma_spec"
    #: the served model's name (traces, ``response_metadata["model_name"]``); None: the node's
    #: target model (its target.model_path's file name), asked once per model instance
    model: Optional[str] = None
    max_tokens: int = 0  # 0 = the node's generation.max_tokens
    temperature: float = 0.0
    stop: Optional[List[str]] = None  # stop strings of every call (a call's own replace them)
    spec_mode: str = ""  # '' = the node's spec.mode
    timeout: float = 300.0  # seconds a turn may take, waiting in the queue included
    streaming: bool = False  # True: invoke() streams too (callbacks get each text piece)
    transport: Optional[Transport] = None  # None: ros_transport(node, timeout)
    _served_model: Optional[str] = None  # what served_model() found (a private attribute)

    @property
    def _llm_type(self) -> str:
        return "gemma-spec-ros"

    def _transport(self) -> Transport:
        return self.transport or ros_transport(self.node, self.timeout)

    def served_model(self) -> str:
        """The model's name: ``model``, else the transport's ``model_name()`` (the node's
        target model), asked once per instance; else the node's path."""
        if self.model:
            return self.model
        if self._served_model is None:
            name = ""
            ask = getattr(self._transport(), "model_name", None)
            try:
                name = str(ask() if callable(ask) else ask or "")
            except Exception:  # noqa: BLE001  a name for traces: never fail a call for it
                name = ""
            self._served_model = name or f"gemma_spec_ros:{self.node}"
        return self._served_model

    def close(self) -> None:
        """Close the transport (the ROS client: its node and executor thread; a later call opens a
        new one). At exit the ROS transports close themselves."""
        if self.transport is None:
            from gemma_spec_ros.client import chat_transport  # noqa: WPS433

            chat_transport(self.node, self.timeout).close()
        elif callable(getattr(self.transport, "close", None)):
            self.transport.close()  # type: ignore[attr-defined]

    def _get_ls_params(self, stop: Optional[List[str]] = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "gemma_spec_ros"
        model = kwargs.get("model")
        params["ls_model_name"] = model if isinstance(model, str) else self.served_model()
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens:
            params["ls_max_tokens"] = max_tokens
        else:
            params.pop("ls_max_tokens", None)  # the node's default
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or ())
        return params

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None,
                   parallel_tool_calls: bool = False, **kwargs: Any) -> Any:
        """The model with ``tools`` (LangChain tools, functions, pydantic models or OpenAI dicts)."""
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], tool_choice=tool_choice,
                         parallel_tool_calls=parallel_tool_calls, **kwargs)

    def with_structured_output(self, schema: Any = None, *, include_raw: bool = False,
                               method: str = "function_calling", strict: Optional[bool] = None,
                               **kwargs: Any) -> Runnable:
        """The model replying with ``schema`` (a pydantic model, a TypedDict, a JSON Schema or an
        OpenAI tool): parsed into an instance of a pydantic model, else a dict. ``method``:
        ``function_calling`` (the schema as the one tool, required), ``json_schema`` (the text
        constrained to the schema), ``json_mode`` (the text constrained to a JSON object; the schema
        only parses it). The node enforces the schema either way: ``strict`` changes nothing."""
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method={method!r}: expected function_calling, json_schema or json_mode")
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if schema is None and method == "json_schema":
            raise ValueError("method='json_schema' needs a schema")
        constraint = convert_to_json_schema(schema) if method == "json_schema" else {"type": "object"}
        llm = self.bind(json_schema=json.dumps(constraint), ls_structured_output_format={
            "kwargs": {"method": method, "strict": strict}, "schema": schema} if schema is not None else None)
        parser: Any = PydanticOutputParser(pydantic_object=schema) \
            if isinstance(schema, type) and is_basemodel_subclass(schema) else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    def _goal(self, messages: Sequence[BaseMessage], stop: Optional[List[str]],
              kwargs: Dict[str, Any]) -> Dict[str, Any]:
        model = kwargs.pop("model", None)
        if model is not None and model != self.served_model():
            raise ValueError(f"the node {self.node} serves {self.served_model()!r}; a call cannot pick "
                             f"another model ({model!r})")
        settings = {"max_tokens": self.max_tokens, "temperature": self.temperature, "spec_mode": self.spec_mode,
                    **kwargs}
        return goal_fields(messages, settings.pop("tools", ()), settings.pop("tool_choice", None),
                           settings.pop("parallel_tool_calls", False), stop if stop is not None else self.stop,
                           **settings)

    def _checked(self, result: Dict[str, Any]) -> Dict[str, Any]:
        if result.get("finish_reason") in FAILED and not result["message"].get("content") and \
                not result["message"].get("tool_calls"):
            raise RuntimeError(f"the node ended the turn with {result['finish_reason']}: {result.get('error')}")
        return result

    def _generate(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        result = self._checked(self._transport()(self._goal(messages, stop, kwargs)))
        message = ai_message(result, self.served_model())
        generation = ChatGeneration(message=message, generation_info=dict(message.response_metadata))
        return ChatResult(generations=[generation])

    def _stream(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                run_manager: Any = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """The turn's text chunk by chunk as the node streams it (the transport's ``stream``), then
        the last chunk: the rest of the text, the calls, the usage and the metadata."""
        goal = self._goal(messages, stop, kwargs)
        transport = self._transport()
        stream = getattr(transport, "stream", None)
        arrivals = stream(goal) if callable(stream) else whole_turn(transport, goal)
        text, result = TextStream(), None
        try:
            for item in arrivals:
                if isinstance(item, Mapping):
                    result = dict(item)
                    continue
                piece = text.push(item)
                if piece:
                    chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                    if run_manager is not None:
                        run_manager.on_llm_new_token(piece, chunk=chunk)
                    yield chunk
        finally:
            if callable(getattr(arrivals, "close", None)):
                arrivals.close()  # a turn left early: the transport cancels it
        if result is None:
            raise RuntimeError("the transport's stream ended without the turn's result")
        last = last_chunk(self._checked(result), text.rest(result["message"].get("content") or ""),
                          self.served_model())
        chunk = ChatGenerationChunk(message=last, generation_info=dict(last.response_metadata))
        if run_manager is not None:
            run_manager.on_llm_new_token(last.text, chunk=chunk)
        yield chunk

    async def _astream(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                       run_manager: Any = None, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        """:meth:`_stream`, each step on the event loop's executor (the wait for the node's next
        text off the loop)."""
        chunks = self._stream(messages, stop, None, **kwargs)
        done = object()
        try:
            while True:
                chunk = await run_in_executor(None, next, chunks, done)
                if chunk is done:
                    break
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            try:
                chunks.close()
            except ValueError:  # still running in the executor (the caller was cancelled)
                pass


__all__ = ["GemmaSpecChat", "TextStream", "Transport", "ai_message", "chat_message", "goal_fields", "last_chunk",
           "ros_transport", "tool_choice_of", "usage_metadata"]
