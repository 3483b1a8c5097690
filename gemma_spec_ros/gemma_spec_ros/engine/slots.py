"""Several requests at once: one target pass per round carries every running request's rows.

Decoding is bound by reading the weights: a pass over a few rows costs little more than a pass over
one (on a 2-core CPU two rows cost ~1.5 passes of one, on a GPU nearly one), so requests that decode
together share that cost. With ``EngineConfig.max_running`` = N > 1 the engine keeps N *slots*: each
is a sequence of the target's context (llama/model.py, one unified KV cache, every sequence with the
whole ``n_ctx``) with its own drafters and their policies. One thread (this module's scheduler) runs
rounds; each round is one ``llama_decode``:

1. every running request past its prompt plans a step as it would alone (steps.py
   ``Steps.plan_step``: its pending token plus its own draft: n-gram, suffix, a draft model's, the text a
   grammar forces), its draft length chosen for the pass it joins (policy/length.py, "Sharing a
   pass": the rows and expected tokens of the others);
2. a request still in its prompt adds a chunk of it (``prompt_chunk`` tokens while others decode,
   ``n_batch`` when it is alone), so a long prompt does not stall the others for its whole length;
3. the pass decodes all rows; each request verifies its own rows, rolls its own sequence back and
   learns from its own draft (steps.py ``Steps.settle_step``), exactly as alone;
4. each request's Step goes to the thread reading its :meth:`SlotScheduler.generate`.

Requests start in the order :meth:`~SlotScheduler.generate` is called (the node's queue decides
that order: priorities, preemption) in the free slot whose sequence shares the longest prefix with
the prompt (prompt reuse per slot). Cancel, close and time budgets are checked per request at every
round; a request whose step fails ends alone with its error, a pass that fails ends the requests in
it. A request's Steps, stats and text are what it would get alone; its logits are not always bit
for bit those of a pass of its own (docs/design.md, "Several requests at once").
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

from .errors import EngineError
from .policy.length import PassShare
from .request import CountedPrompt, GenerationRequest, Step
from .request_state import RequestState
from .steps import MAX_VERIFY_ROWS, PlannedStep, Steps

if TYPE_CHECKING:
    from .propose import Drafting

#: Prompt tokens a starting request adds to a pass that also carries other requests' steps: a
#: chunk costs about as much as a few steps (on a 2-core CPU 64 prompt tokens of the 270M model
#: take ~4 one-row passes), so the others wait a few steps' time for each, not the whole prompt's.
PROMPT_CHUNK = 64


class _StopEvents:
    """Stop if any of these events is set (the caller's cancel, the reader leaving)."""

    def __init__(self, *events: Optional[threading.Event]) -> None:
        self._events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)


@dataclass
class _Ticket:
    """A request handed to the scheduler, and the queue its Steps (or its error) come back in."""

    request: GenerationRequest
    counted: CountedPrompt  # its checked prompt: tokens, chat turn, compiled constraint
    cancel: Optional[threading.Event]
    left: threading.Event = field(default_factory=threading.Event)  # the reader stopped reading
    out: "queue.SimpleQueue[Any]" = field(default_factory=queue.SimpleQueue)

    @property
    def stop(self) -> _StopEvents:
        return _StopEvents(self.cancel, self.left)


@dataclass
class _Slot:
    """One sequence of the target with its drafters, and the request it serves (if any)."""

    seq: int
    kv: Any  # llama/model.py SequenceView
    drafters: Dict[str, "Drafting"]
    ticket: Optional[_Ticket] = None
    state: Optional[RequestState] = None
    rest: Optional[List[int]] = None  # prompt tokens not decoded yet (None: not begun)
    prompting: bool = False
    prompt_started: float = 0.0


@dataclass
class PassCounts:
    """What the rounds have done since the engine started: for /diagnostics."""

    passes: int = 0
    rows: int = 0
    requests: int = 0  # request steps carried (a pass with three requests' steps counts three)

    @property
    def rows_per_pass(self) -> float:
        return self.rows / self.passes if self.passes else 0.0

    @property
    def requests_per_pass(self) -> float:
        return self.requests / self.passes if self.passes else 0.0


class SlotScheduler:
    """Runs the rounds of several requests at once over the target of ``steps`` (module docstring).

    The scheduler's thread holds ``lock`` (the engine's generation lock) for its whole life and is
    the only thread that touches the models; the rounds end when the engine is closing, and the
    thread then calls ``on_exit`` (the engine frees its models). :meth:`generate` is called from
    any thread.
    """

    def __init__(self, steps: Steps, slots: List[Tuple[Any, Dict[str, "Drafting"]]], lock: threading.Lock,
                 on_exit: Callable[[], None], prompt_chunk: int = PROMPT_CHUNK) -> None:
        self._steps = steps
        self._lock = lock
        self._on_exit = on_exit
        self._slots = [_Slot(i, kv, drafters) for i, (kv, drafters) in enumerate(slots)]
        self._prompt_chunk = max(1, prompt_chunk)
        #: requests started at once (at most the slots): the engine lowers it to 1 where batching
        #: was measured not to pay (Engine.max_running), and says why in ``why``
        self.limit = len(self._slots)
        self.why = ""
        self._waiting: Deque[_Ticket] = deque()
        self._cond = threading.Condition()
        self.counts = PassCounts()
        self._thread = threading.Thread(target=self._run, name="gemma_spec_slots", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def running(self) -> int:
        """Requests in a slot now (their prompt or their steps)."""
        return sum(1 for slot in self._slots if slot.ticket is not None)

    def generate(self, request: GenerationRequest, prompt: CountedPrompt,
                 cancel: Optional[threading.Event]) -> Iterator[Step]:
        """The request's Steps as its rounds make them; raises what its step raised. ``prompt``:
        its counted prompt, checked. A reader that stops reading ends the request at the next round."""
        ticket = _Ticket(request, prompt, cancel)
        with self._cond:
            if self._steps.closing:
                raise EngineError("the engine is closed")
            self._waiting.append(ticket)
            self._cond.notify_all()
        try:
            while True:
                item = ticket.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            ticket.left.set()
            self.wake()

    def wake(self) -> None:
        """Let the scheduler look again (a request was cancelled, the engine is closing)."""
        with self._cond:
            self._cond.notify_all()

    def join(self, timeout: Optional[float]) -> bool:
        """Wait for the scheduler's thread to end (the engine is closing); True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """The scheduler's thread runs (it ends only when the engine closes)."""
        return self._thread.is_alive()

    # -- the scheduler's thread ------------------------------------------------------------------
    def _run(self) -> None:
        """Rounds until the engine closes. A fault outside any one request's step (which
        :meth:`_round` gives to that request) ends the requests in the slots with it, is reported,
        and the rounds go on: this thread is the only one that serves, and the models are freed
        only when the engine closes."""
        with self._lock:  # the models are the scheduler's until it ends
            try:
                while True:
                    try:
                        if not self._next_round():
                            break
                        self._round()
                    except Exception as exc:  # noqa: BLE001  see the docstring
                        self._steps.report(f"several requests at once: a round failed and the "
                                           f"scheduler goes on: {exc!r}")
                        for slot in self._slots:
                            if slot.ticket is not None:
                                self._fail(slot, exc)
            finally:
                self._end_all()
                self._on_exit()  # the engine is closing (that ended the rounds): its models go

    def _next_round(self) -> bool:
        """Wait until a request runs or waits for a free slot, start the waiting ones that fit;
        False once the engine is closing."""
        steps = self._steps
        with self._cond:
            while not steps.closing:
                free = [slot for slot in self._slots if slot.ticket is None]
                if any(slot.ticket is not None for slot in self._slots) or (self._waiting and free):
                    break
                self._cond.wait()
            if steps.closing:
                return False
            starting = []
            while self._waiting and self.running() < self.limit:
                ticket = self._waiting.popleft()
                slot = self._free_slot(ticket.counted.tokens)
                slot.ticket = ticket
                starting.append(slot)
        for slot in starting:
            self._start(slot)
        return True

    def _free_slot(self, prompt: Sequence[int]) -> _Slot:
        """The free slot whose sequence can keep the longest prefix of ``prompt`` (its sliding
        window included: LlamaModel.reusable_prefix)."""
        return max((slot for slot in self._slots if slot.ticket is None),
                   key=lambda slot: slot.kv.reusable_prefix(prompt, keep_last=1))

    def _begin_prompt(self, slot: _Slot) -> None:
        """The slot's prompt is next to decode: where another slot's sequence (running or not)
        holds a longer prefix of it, those cells become this slot's too (LlamaModel.share_prefix:
        a system prompt every client sends is decoded once); then what is left to decode."""
        prompt = slot.state.prompt
        shared = {other.seq: other.kv.reusable_prefix(prompt, keep_last=1) for other in self._slots}
        donor = max(self._slots, key=lambda other: shared[other.seq])
        if shared[donor.seq] - shared[slot.seq] >= self._prompt_chunk:  # worth more than a chunk
            self._steps.target.share_prefix(donor.seq, slot.seq, shared[donor.seq])
        slot.rest = self._steps.prompt_rest(slot.state)

    def _start(self, slot: _Slot) -> None:
        ticket = slot.ticket
        assert ticket is not None
        try:
            state = self._steps.start_request(ticket.request, ticket.counted, ticket.stop, slot.kv, slot.drafters)
        except BaseException as exc:  # noqa: BLE001  e.g. a grammar that does not compile
            self._release(slot, exc)
            return
        slot.state = state
        slot.prompting = True
        slot.rest = None  # known when its prompt is next (_begin_prompt)
        slot.prompt_started = time.perf_counter()

    def _round(self) -> None:
        """One pass over every running request (module docstring)."""
        steps = self._steps
        spec = steps.spec
        started = time.perf_counter()
        decoding = [slot for slot in self._slots if slot.state is not None and not slot.prompting]
        prompting = [slot for slot in self._slots if slot.state is not None and slot.prompting]
        decoding = [slot for slot in decoding if not self._stopped_between_passes(slot)]
        prompting = [slot for slot in prompting if not self._stopped_between_passes(slot)]
        # (a request whose end failed there has ended with its error; a slot left is one that runs)
        decoding = [slot for slot in decoding if slot.state is not None]
        prompting = [slot for slot in prompting if slot.state is not None]
        chunk_slot = prompting[0] if prompting else None
        chunk: List[int] = []
        if chunk_slot is not None and chunk_slot.rest is None:
            try:
                self._begin_prompt(chunk_slot)
            except BaseException as exc:  # noqa: BLE001
                self._fail(chunk_slot, exc)
                chunk_slot = None
        if chunk_slot is not None:
            size = self._prompt_chunk if decoding else steps.target.n_batch
            room = steps.target.n_batch - MAX_VERIFY_ROWS * len(decoding)
            chunk = chunk_slot.rest[:max(1, min(size, room))]
        planned: List[Tuple[_Slot, PlannedStep]] = []
        rows, expected = len(chunk), 0.0
        undecided = len(decoding)
        for slot in decoding:
            undecided -= 1
            share = PassShare(rows + undecided, expected + undecided)
            try:
                step = steps.plan_step(slot.state, share, spec)
            except BaseException as exc:  # noqa: BLE001  one request's fault is its own
                self._fail(slot, exc)
                continue
            planned.append((slot, step))
            rows += len(step.batch)
            expected += step.proposal.decision.expected_tokens + step.proposal.n_forced
        parts = [(slot.seq, step.batch, step.logit_rows) for slot, step in planned]
        last_chunk = chunk_slot is not None and len(chunk) == len(chunk_slot.rest)
        if chunk:
            parts.append((chunk_slot.seq, chunk, range(len(chunk) - 1, len(chunk)) if last_chunk else ()))
        if not parts:
            return
        t0 = time.perf_counter()
        try:
            outputs = steps.target.decode_parts(parts)
        except BaseException as exc:  # noqa: BLE001  the pass failed: every request in it ends
            for slot, _ in planned:
                self._fail(slot, exc)
            if chunk:
                self._fail(chunk_slot, exc)
            return
        seconds = time.perf_counter() - t0
        self.counts.passes += 1
        self.counts.rows += rows
        self.counts.requests += len(planned) + (1 if chunk else 0)
        if not chunk and all(step.every_row for _, step in planned):  # a pass the cost model's sizes describe
            steps.costs.observe_verify(rows, seconds)
        for (slot, step), logits in zip(planned, outputs):
            state = slot.state
            state.stats.verify_time += seconds
            try:
                tokens = steps.settle_step(state, step, step.spread(logits))
                out = state.emit(tokens, spec, step.proposal.draft.source or None)
            except BaseException as exc:  # noqa: BLE001
                self._fail(slot, exc)
                continue
            self._deliver(slot, out)
        if chunk:
            self._prompt_chunk_done(chunk_slot, chunk, outputs[-1], started)

    def _prompt_chunk_done(self, slot: _Slot, chunk: List[int], logits: Any, started: float) -> None:
        """A chunk of ``slot``'s prompt is decoded; after the last, its first token is sampled."""
        steps, state = self._steps, slot.state
        del slot.rest[:len(chunk)]
        state.stats.prompt_time += time.perf_counter() - started
        if slot.rest:
            return
        try:
            first = steps.prompt_done(state, logits)
            slot.prompting = False
            out = state.emit((first,), steps.spec)
        except BaseException as exc:  # noqa: BLE001
            self._fail(slot, exc)
            return
        self._deliver(slot, out)

    def _stopped_between_passes(self, slot: _Slot) -> bool:
        """End the slot's request here if a stop was asked (cancel, the reader left) or, in its
        prompt, its time budget ran out; True if it ended (with its error, if its last step could
        not be made: a chat turn's reply is read there)."""
        state = slot.state
        try:
            if state.ends.stop_requested():
                finish = "cancelled"
            elif slot.prompting and state.over_budget():
                finish = "timeout"
            else:
                return False
            last = state.step(self._steps.spec, finish)
        except Exception as exc:  # noqa: BLE001  one request's fault is its own
            self._fail(slot, exc)
            return True
        self._deliver(slot, last)
        return True

    def _deliver(self, slot: _Slot, step: Step) -> None:
        """Hand ``step`` to the request's reader; the last one frees the slot."""
        slot.ticket.out.put(step)
        if step.finish_reason is not None:
            try:
                self._end_request(slot)
            finally:
                self._release(slot)

    def _fail(self, slot: _Slot, exc: BaseException) -> None:
        """The request ends with ``exc``: its sequence is emptied (the cache may not hold what its
        tokens say), its drafters still learn what it emitted."""
        try:
            slot.kv.clear()
        finally:
            try:
                self._end_request(slot)
            finally:
                self._release(slot, exc)

    def _end_request(self, slot: _Slot) -> None:
        """The request's end (its drafters learn, its stats roll up); a failure there is the
        engine's to report (the request has its last step or its error already), never the
        scheduler's end."""
        if slot.state is not None:
            state, slot.state = slot.state, None
            try:
                self._steps.end_request(state)
            except Exception as exc:  # noqa: BLE001
                self._steps.report(f"the end of a request failed: {exc!r}")

    def _release(self, slot: _Slot, exc: Optional[BaseException] = None) -> None:
        ticket, slot.ticket = slot.ticket, None
        slot.state, slot.rest, slot.prompting = None, None, False
        if exc is not None and ticket is not None:
            ticket.out.put(exc)

    def _end_all(self) -> None:
        """The engine is closing: running requests end cancelled, waiting ones with an error."""
        spec = self._steps.spec
        for slot in self._slots:
            if slot.state is not None:
                try:
                    self._deliver(slot, slot.state.step(spec, "cancelled"))
                except BaseException as exc:  # noqa: BLE001
                    self._release(slot, exc)
            elif slot.ticket is not None:
                self._release(slot, EngineError("the engine is closed"))
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for ticket in waiting:
            ticket.out.put(EngineError("the engine is closed"))


__all__ = ["PROMPT_CHUNK", "PassCounts", "SlotScheduler"]
