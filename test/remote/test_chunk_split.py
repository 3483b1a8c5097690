"""A chat turn's text and calls on the remote backend are the same however the server's stream is cut.

Speculative decoding emits several tokens at once, so a server's events carry runs of tokens: a
text's tail and a call's start in one delta, several argument pieces of one call (merged, or as
separate ``tool_calls`` entries of the same index), pieces of two calls. Serving engines have
shipped tool-call parsers that broke exactly there. And the bytes of the event stream reach the
reader in reads cut anywhere: inside the ``data:`` prefix, inside a JSON string, inside a UTF-8
character, between ``\\r`` and ``\\n``.

One model output (text with multi-byte characters, then two calls) is streamed as OpenAI-compatible
chat-completion events in several groupings of its tokens, and each grouping's bytes in hundreds of
cuttings, every one through the real path: a loopback server (:class:`support.servers.
ScriptedStreamServer`, a fake) writes each piece of a cutting as its own HTTP chunk (a read never
spans two chunks, so the reader sees at least these cuts), and :class:`RemoteEngine` reads the
stream (sse.py) and puts the calls together (chat.py). Every run gives the same streamed text, the
same calls and no error.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

from gemma_spec_ros.engine.config import SpecConfig
from gemma_spec_ros.engine.remote import RemoteConfig, RemoteEngine
from gemma_spec_ros.engine.request import GenerationRequest
from support.chat import planner_conversation
from support.servers import SSE_CHUNKED_HEAD, ScriptedStreamServer, chunk

#: The model's output: text (2-, 3- and 4-byte UTF-8 characters), then two calls.
CONTENT = "On it — 走る 🤖, ça."
CALLS: Tuple[Tuple[str, Dict[str, Any]], ...] = (("move_to", {"place": "kitchen", "speed": 0.5}),
                                                 ("say", {"text": "ça va ✓ 🤖"}))
#: Token groupings (seeds), each streamed in its own cuttings: the first one token per event.
GROUPINGS = range(6)
#: Random cuttings per grouping, beside the targeted ones.
RANDOM_CUTTINGS = 60
#: The grouping also cut at every single position (runs of several tokens per event, fragments of
#: one call both merged and as entries of their own, keep-alive comments, CRLF).
EVERY_CUT_GROUPING = 3


@dataclass(frozen=True)
class Token:
    """One generated token: a piece of the text, or of a call (``opens``: the call's first token,
    which brings its id and name)."""

    text: str
    call: int = -1  # the call's index; -1 = text
    opens: bool = False


def pieces(text: str, rng: random.Random, longest: int) -> List[str]:
    """``text`` cut into pieces of 1..``longest`` characters."""
    out, at = [], 0
    while at < len(text):
        size = rng.randint(1, longest)
        out.append(text[at:at + size])
        at += size
    return out


def tokens(rng: random.Random) -> List[Token]:
    out = [Token(piece) for piece in pieces(CONTENT, rng, 3)]
    for index, (_, arguments) in enumerate(CALLS):
        out.append(Token("", index, opens=True))
        out += [Token(piece, index) for piece in pieces(json.dumps(arguments, ensure_ascii=False), rng, 4)]
    return out


def delta(group: Sequence[Token], rng: random.Random) -> Dict[str, Any]:
    """One event's delta for a run of tokens: their text, and their call fragments, a piece of the
    call just before either merged into its fragment or sent as an entry of its own."""
    fragments: List[Dict[str, Any]] = []
    for token in group:
        if token.call < 0:
            continue
        if token.opens:
            fragments.append({"index": token.call, "id": f"call_{token.call}", "type": "function",
                              "function": {"name": CALLS[token.call][0], "arguments": ""}})
        elif fragments and fragments[-1]["index"] == token.call and rng.random() < 0.5:
            fragments[-1]["function"]["arguments"] += token.text
        else:
            fragments.append({"index": token.call, "function": {"arguments": token.text}})
    text = "".join(token.text for token in group if token.call < 0)
    out: Dict[str, Any] = {"content": text} if text else {"content": None} if rng.random() < 0.3 else {}
    if fragments:
        out["tool_calls"] = fragments
    return out


def event_stream(seed: int) -> bytes:
    """The whole response body of one grouping: its events, then [DONE]. Seed 0: one token per
    event; others: runs of 1..5 tokens; odd seeds end lines with CRLF; every third has keep-alive
    comments; seed 2 writes ``data:`` without its space."""
    rng = random.Random(seed)
    generated = tokens(rng)
    groups: List[List[Token]] = []
    while len(generated) > sum(map(len, groups)):
        at = sum(map(len, groups))
        groups.append(generated[at:at + (1 if seed == 0 else rng.randint(1, 5))])
    eol = "\r\n" if seed % 2 else "\n"
    prefix = "data:" if seed == 2 else "data: "
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    events += [{"choices": [{"index": 0, "delta": delta(group, rng), "finish_reason": None}]} for group in groups]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                   "usage": {"prompt_tokens": 90, "completion_tokens": len(generated)}})
    lines = []
    for event in events:
        if seed % 3 == 0:
            lines.append(": keep-alive" + eol * 2)
        event.update(id="chatcmpl-1", object="chat.completion.chunk", model="m")
        lines.append(prefix + json.dumps(event, ensure_ascii=False) + eol * 2)
    return "".join(lines + [prefix + "[DONE]" + eol * 2]).encode()


def targeted_cuts(body: bytes) -> List[int]:
    """Cut positions the reader must survive: inside each ``data:`` prefix, inside a JSON string
    (a call's argument value), before every UTF-8 continuation byte (inside a character), between
    ``\\r`` and ``\\n``."""
    cuts = [i + 2 for i in _find_all(body, b"data:")]
    cuts += [i + 3 for i in _find_all(body, b"kit")] + [i + 1 for i in _find_all(body, b'"move_to"')]
    cuts += [i for i, byte in enumerate(body) if 0x80 <= byte < 0xC0]
    cuts += [i + 1 for i in _find_all(body, b"\r\n")]
    return sorted(set(cuts))


def _find_all(body: bytes, needle: bytes) -> Iterator[int]:
    at = body.find(needle)
    while at >= 0:
        yield at
        at = body.find(needle, at + 1)


def cuttings(body: bytes, seed: int) -> List[List[bytes]]:
    """The pieces of every cutting of ``body`` tried: each targeted position alone (every position,
    for :data:`EVERY_CUT_GROUPING`) and beside two random ones; random cuttings with 1 to 3 cuts;
    and a few that cut everywhere in 1..7 bytes."""
    rng = random.Random(1000 + seed)
    alone = range(1, len(body)) if seed == EVERY_CUT_GROUPING else targeted_cuts(body)
    positions: List[List[int]] = [[cut] for cut in alone]
    positions += [[cut, *rng.sample(range(1, len(body)), 2)] for cut in targeted_cuts(body)[::3]]
    positions += [rng.sample(range(1, len(body)), rng.randint(1, 3)) for _ in range(RANDOM_CUTTINGS)]
    for _ in range(5):
        cuts, at = [], 0
        while at < len(body):
            at += rng.randint(1, 7)
            cuts.append(at)
        positions.append(cuts)
    out = []
    for cuts in positions:
        bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(body))), len(body)]
        out.append([body[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def serve(queue: List[List[bytes]]) -> Callable[[Callable[[bytes], bool]], None]:
    """A script that answers each request with the next cutting of ``queue``, a piece per HTTP
    chunk (written at once: no wait between pieces, and reads still stop at every chunk's end)."""
    def script(send: Callable[[bytes], bool]) -> None:
        send(SSE_CHUNKED_HEAD + b"".join(chunk(piece) for piece in queue.pop(0)) + chunk(b""))
    return script


def test_the_stream_cut_anywhere_gives_the_same_text_and_calls() -> None:
    conversation = planner_conversation("auto", parallel=True)
    request = GenerationRequest(conversation=conversation, max_tokens=64)
    expected = (CONTENT, CONTENT, [(name, arguments) for name, arguments in CALLS], "", "tool_calls")
    queue: List[List[bytes]] = []
    with ScriptedStreamServer(serve(queue), routes={"POST /v1/chat/completions": serve(queue)}) as fake:
        engine = RemoteEngine(RemoteConfig(url=fake.url, probe_period=0, connect_timeout=2.0,
                                           read_timeout=10.0), SpecConfig())
        try:
            tried = 0
            for seed in GROUPINGS:
                body = event_stream(seed)
                for cutting in cuttings(body, seed):
                    assert b"".join(cutting) == body
                    queue.append(cutting)
                    steps = list(engine.generate(request))
                    last, reply = steps[-1], steps[-1].reply
                    assert reply is not None
                    got = ("".join(step.text for step in steps), reply.content,
                           [(c.name, json.loads(c.arguments)) for c in reply.tool_calls], reply.error,
                           reply.finish_reason(last.finish_reason))
                    assert got == expected, (seed, [len(piece) for piece in cutting])
                    tried += 1
        finally:
            engine.close()
    assert tried == sum(len(cuttings(event_stream(seed), seed)) for seed in GROUPINGS) > 4000, tried
