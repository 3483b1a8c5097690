"""The request log: the requests a node served and the target's replies, kept (opt-in) as training
data for a draft head (an EAGLE-3 head learns the target's own distribution on the robot's own
prompts; ``gemma-spec-export-traffic`` turns the log into the conversation datasets the trainers read).

What is recorded, per request that finished (``stop``, ``length``, ``tool_calls``; never a refused,
cancelled, preempted, timed-out or failed one): a prompt (its text, system prompt, whether the chat
template was used) and the reply's text; or a chat turn (its messages and tools in OpenAI's shapes,
``tool_choice``) and the assistant message it produced, calls included; plus a random id, the finish reason, the
speculative mode in effect, the target, a UTC timestamp, the sampling temperature, the token counts
and whether the request carried a grammar of its own.

File layout: JSON Lines in UTF-8, one record per line, behind a first line this project owns::

    {"format": "gemma_spec_ros.traffic", "version": 1}
    {"kind": "generate", "time": "2025-06-01T12:00:00.000+00:00", ...}
    {"kind": "chat", ...}

The file rules are the learned n-gram cache's (docs/security.md): the log lies in the node's cache
folder; only a regular file that starts with :data:`HEADER` is appended to, rotated or trimmed; any
other file at its path (or at the rotated file's) fails configure with the reason and is left
untouched. The log is bounded: it and its one rotated file, ``<log>.1``, each hold at most half of
``max_bytes``; when a record would not fit, the log becomes ``<log>.1`` (a rename, replacing the older
one: the oldest records go) and a new log starts. Every step is crash-safe: a record is one
``write`` of a whole line to a descriptor opened for appending; a new file is created with its
header in place (:func:`~gemma_spec_ros.engine.files.create_exclusively`); a rotation is a rename. A
crash can only tear the last line, which readers ignore and the next writer trims.

Nothing here raises into a request: :meth:`TrafficLog.record` returns a fault for the owner to
report (the node's "last internal error"), once per kind of failure until a record is written again.
"""
from __future__ import annotations

import datetime
import json
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from .config import expand_path
from .errors import EngineError
from .files import create_exclusively, write_atomically_from

#: The format's name and version, in the header line.
FORMAT = "gemma_spec_ros.traffic"
VERSION = 1
#: The first line of every log file: the bytes that make a file the node's own.
HEADER = (json.dumps({"format": FORMAT, "version": VERSION}) + "\n").encode("ascii")
#: The start of the header of any version of this format (a log of another version is refused
#: with words of its own, and left untouched like any other file).
FORMAT_PREFIX = json.dumps({"format": FORMAT})[:-1].encode("ascii")
#: The rotated file: ``<log>`` + this.
ROTATED_SUFFIX = ".1"
#: The smallest bound the log takes (its parameter's range starts far higher).
MIN_MAX_BYTES = 4096
#: The finish reasons of a request that is recorded.
FINISHED: Tuple[str, ...] = ("stop", "length", "tool_calls")
#: The kinds of record.
KINDS: Tuple[str, ...] = ("generate", "chat")
#: Mode of a folder the log's file is put in, created inside the cache folder (the log holds
#: clients' prompts: only the node's user may read it; the file itself is created 0600).
FOLDER_MODE = 0o700
_CHUNK = 1 << 20
_OPEN_FLAGS = os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO cannot hang the caller


class TrafficLogError(EngineError):
    """The request log cannot be used or written; the message says why."""


class ForeignLogError(TrafficLogError):
    """A file at the log's path that this node did not write as its log: refused, left untouched."""


class RecordTooLargeError(TrafficLogError):
    """A record longer than half the log's bound: not written."""


def resolve_path(path: str, cache_dir: str) -> str:
    """``traffic.log_path`` as an absolute path ('' = no log): a file name (a relative path) lies in
    ``lookup.cache_dir``; an absolute path must lie inside it too (when it is set). ValueError with
    the reason otherwise.

    >>> resolve_path("traffic.jsonl", "/var/cache/gs"), resolve_path("", "/c")
    ('/var/cache/gs/traffic.jsonl', '')
    >>> resolve_path("/tmp/t.jsonl", "/var/cache/gs")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: traffic.log_path '/tmp/t.jsonl' is outside lookup.cache_dir '/var/cache/gs': ...
    """
    if not path:
        return ""
    expanded, folder = expand_path(path), expand_path(cache_dir)
    if not os.path.isabs(expanded):
        if not folder:
            raise ValueError(f"traffic.log_path {path!r} is relative to lookup.cache_dir, which is '': "
                             "give an absolute path")
        expanded = os.path.join(folder, expanded)
    expanded = os.path.abspath(expanded)
    if folder and not _inside(os.path.dirname(expanded), os.path.abspath(folder)):
        raise ValueError(f"traffic.log_path {path!r} is outside lookup.cache_dir {cache_dir!r}: the node "
                         "writes only there (lookup.cache_dir is set at launch only)")
    return expanded


def _inside(folder: str, root: str) -> bool:
    """Whether ``folder`` is ``root`` or below it, links resolved (a link inside ``root`` that leads
    out of it does not count as inside)."""
    real_root = os.path.realpath(root)
    return os.path.commonpath([os.path.realpath(folder), real_root]) == real_root


def open_log(path: str, max_bytes: int, cache_dir: str, *, target: str = "",
             others: Sequence[str] = ()) -> Optional["TrafficLog"]:
    """The request log the parameters name (None: ``path`` is '', no log), checked and made ready:
    the path resolved (:func:`resolve_path`), not one of ``others`` (the node's other files), its
    folder created inside ``cache_dir`` if missing, the file and its rotated file absent or the
    log's own (:class:`ForeignLogError` otherwise, the file untouched), a torn last line trimmed and
    the bound applied. Raises ValueError or TrafficLogError with the reason."""
    resolved = resolve_path(path, cache_dir)
    if not resolved:
        return None
    mine = {os.path.realpath(resolved), os.path.realpath(resolved + ROTATED_SUFFIX)}
    for other in others:
        if other and os.path.realpath(expand_path(other)) in mine:
            raise ValueError(f"traffic.log_path {path!r} names the same file as {other!r}: the request log "
                             "needs a file of its own")
    _prepare_folder(os.path.dirname(resolved), expand_path(cache_dir))
    return TrafficLog(resolved, max_bytes, target=target)


def _prepare_folder(folder: str, cache_dir: str) -> List[str]:
    """Create the log's folder where the node owns the place (inside ``cache_dir``, as ``mkdir -p``
    would, each folder :data:`FOLDER_MODE`); the folders created. A folder elsewhere must exist."""
    if os.path.isdir(folder):
        return []
    if not cache_dir or not _inside(folder, os.path.abspath(cache_dir)):
        raise TrafficLogError(f"the request log's folder {folder} does not exist: create it, or set "
                              "traffic.log_path to '' (no log)")
    missing = [p for p in (Path(folder), *Path(folder).parents) if not p.exists()][::-1]
    created = []
    for step in missing:
        try:
            step.mkdir(mode=FOLDER_MODE)
        except FileExistsError:
            pass
        except OSError as error:
            raise TrafficLogError(f"cannot create {step} for the request log: {error.strerror or error}") from None
        else:
            created.append(os.fspath(step))
    if not os.path.isdir(folder):
        raise TrafficLogError(f"{folder} is not a folder: the request log cannot go there")
    return created


def _state(path: str) -> Optional[str]:
    """None if nothing is at ``path``; else ``own`` (a regular file with :data:`HEADER`),
    ``version`` (a log of another version of the format) or ``foreign``."""
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ForeignLogError(f"cannot check {path} (the request log): {error.strerror or error}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "foreign"
        head = os.pread(fd, len(HEADER), 0)
    finally:
        os.close(fd)
    if head == HEADER:
        return "own"
    return "version" if head.startswith(FORMAT_PREFIX) else "foreign"


def check_own(path: str) -> None:
    """Raise :class:`ForeignLogError` unless ``path`` is absent or the log's own file."""
    state = _state(path)
    if state == "foreign":
        raise ForeignLogError(
            f"{path} is not a request log written by gemma_spec_ros (no header of its own): it is left "
            "untouched and not used; point traffic.log_path at a new file or at a log this node wrote")
    if state == "version":
        raise ForeignLogError(
            f"{path} is a request log of another format version (this node writes version {VERSION}): "
            "it is left untouched; export it with the version that wrote it, then move it away")


class TrafficLog:
    """The bounded request log at ``path`` (see the module docstring); thread-safe.

    ``max_bytes``: the log and its rotated file together stay within it (each holds at most half).
    ``target``: the model the replies come from, written into each record. Raises
    :class:`ForeignLogError` if a file at ``path`` or its rotated path is not the log's own (the
    file untouched), OSError if one cannot be read or trimmed.
    """

    def __init__(self, path: str, max_bytes: int, *, target: str = "") -> None:
        if max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"the request log's bound of {max_bytes} bytes is below {MIN_MAX_BYTES}")
        self.path = os.fspath(path)
        self.rotated = self.path + ROTATED_SUFFIX
        self.max_bytes = max_bytes
        self.half = max_bytes // 2
        self.target = target
        #: records that could not be written (their faults were reported, some of them once)
        self.unwritten = 0
        self._last_fault: Optional[Tuple[str, Any]] = None
        self._lock = threading.Lock()
        for file in (self.rotated, self.path):
            check_own(file)
        for file in (self.rotated, self.path):
            if _state(file) == "own":
                self._repair(file)
        create_exclusively(self.path, HEADER)  # the log starts here (if it is new): 0600 from the start

    # -- recording ---------------------------------------------------------------------------------
    def record(self, request: Any, text: str, finish_reason: str, step: Any) -> str:
        """Record a request that ended (its text streamed, the goal's finish reason, its last step):
        '' when recorded or not to be recorded, else the fault to report. Never raises."""
        try:
            entry = entry_of(request, text, finish_reason, step, target=self.target)
            if entry is None:
                return ""
            self.append(entry)
        except Exception as exc:  # noqa: BLE001  a record that fails must never fail its goal
            return self._fault(exc)
        with self._lock:
            self._last_fault = None
        return ""

    def _fault(self, exc: BaseException) -> str:
        kind = (type(exc).__name__, getattr(exc, "errno", None))
        with self._lock:
            self.unwritten += 1
            if kind == self._last_fault:
                return ""
            self._last_fault = kind
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return (f"request log {self.path}: a served request was not recorded ({detail}); the goal is "
                "not affected, and the same failure is not reported again until a record is written")

    def append(self, entry: Mapping[str, Any]) -> None:
        """Append one record (a JSON object), rotating first when it would not fit. Raises
        :class:`RecordTooLargeError`, :class:`ForeignLogError` (a file that is not the log's own
        appeared at its path: left untouched), or OSError."""
        line = encode(entry)
        if len(HEADER) + len(line) > self.half:
            raise RecordTooLargeError(f"a record of {len(line)} bytes does not fit in half of the log's "
                                      f"bound ({self.max_bytes} bytes, traffic.max_bytes)")
        with self._lock:
            fd = self._open_for_append()
            try:
                size = os.fstat(fd).st_size
                if size + len(line) > self.half:
                    os.close(fd)
                    fd = -1
                    self._rotate()
                    fd = self._open_for_append()
                    size = os.fstat(fd).st_size
                _write_line(fd, line, size)
            finally:
                if fd >= 0:
                    os.close(fd)

    def _open_for_append(self) -> int:
        """A descriptor of the log for appending: created with its header if missing, checked to be
        the log's own, a torn last line trimmed."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | _OPEN_FLAGS)
            except FileNotFoundError:
                create_exclusively(self.path, HEADER)  # False: made meanwhile; checked below
                continue
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or os.pread(fd, len(HEADER), 0) != HEADER:
                    raise ForeignLogError(f"{self.path} is no longer the request log this node wrote: "
                                          "it is left untouched, and nothing is recorded there")
                _trim_torn_line(fd, info.st_size)
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise TrafficLogError(f"{self.path} disappeared while the request log was being created")

    def _rotate(self) -> None:
        """The log becomes the rotated file (the older one goes), and a new log starts."""
        check_own(self.rotated)
        os.replace(self.path, self.rotated)
        create_exclusively(self.path, HEADER)  # syncs the folder: the rename is durable with it

    # -- at open -----------------------------------------------------------------------------------
    def _repair(self, file: str) -> None:
        """Trim a torn last line; keep only the newest records within half the bound."""
        fd = os.open(file, os.O_RDWR | _OPEN_FLAGS)
        try:
            size = _trim_torn_line(fd, os.fstat(fd).st_size)
            if size > self.half:
                _keep_newest(fd, file, size, self.half)
        finally:
            os.close(fd)


def _write_line(fd: int, line: bytes, size: int) -> None:
    """Append ``line`` whole; a failed write is cut back to ``size`` (best effort)."""
    written = 0
    try:
        while written < len(line):
            count = os.write(fd, line[written:])
            if count <= 0:
                raise OSError("the request log took no bytes")
            written += count
    except OSError:
        if written:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass  # the next append trims the torn line
        raise


def _trim_torn_line(fd: int, size: int) -> int:
    """Cut a last line without its newline (a write a crash tore) from the own file ``fd``; its
    size after."""
    if size <= len(HEADER) or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    while end > len(HEADER):
        start = max(len(HEADER), end - 65536)
        chunk = os.pread(fd, end - start, start)
        at = chunk.rfind(b"\n")
        if at >= 0:
            end = start + at + 1
            break
        end = start
    os.ftruncate(fd, end)
    os.fsync(fd)
    return end


def _keep_newest(fd: int, file: str, size: int, limit: int) -> None:
    """Rewrite ``file`` as its header and the newest whole lines that fit within ``limit`` bytes."""
    start = size - (limit - len(HEADER))
    if os.pread(fd, 1, start - 1) != b"\n":  # inside a line: from the next one
        while start < size:
            chunk = os.pread(fd, min(_CHUNK, size - start), start)
            at = chunk.find(b"\n")
            if at >= 0:
                start += at + 1
                break
            start += len(chunk)

    def chunks() -> Iterator[bytes]:
        yield HEADER
        at = start
        while at < size:
            chunk = os.pread(fd, min(_CHUNK, size - at), at)
            if not chunk:
                return
            yield chunk
            at += len(chunk)

    write_atomically_from(file, chunks())


def encode(entry: Mapping[str, Any]) -> bytes:
    """One record as its line: compact JSON (non-ASCII kept as UTF-8), a newline.

    >>> encode({"kind": "generate", "text": "Grüß"})
    b'{"kind":"generate","text":"Gr\\xc3\\xbc\\xc3\\x9f"}\\n'
    """
    return (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def now_utc() -> str:
    """The time of a record: ISO 8601, UTC, milliseconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def entry_of(request: Any, text: str, finish_reason: str, step: Any, *, target: str = "",
             time: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The record of a request that ended (None: not to be recorded, it did not finish).

    ``request``: the GenerationRequest; ``text``: the text streamed; ``finish_reason``: the goal's;
    ``step``: the last step (its ``reply`` for a chat turn, ``spec_mode``, ``stats``)."""
    if step is None:
        return None
    conversation = request.conversation
    reply = getattr(step, "reply", None)
    if conversation is not None:
        content = reply.content if reply is not None else text.strip()
        calls = tuple(reply.tool_calls) if reply is not None else ()
        if calls and finish_reason == "stop":  # as the chat result says it (AssistantReply.finish_reason)
            finish_reason = "tool_calls"
    if finish_reason not in FINISHED:
        return None
    stats = step.stats
    entry: Dict[str, Any] = {
        "kind": "chat" if conversation is not None else "generate", "id": os.urandom(8).hex(),
        "time": time or now_utc(), "target": target, "finish_reason": finish_reason,
        "spec_mode": step.spec_mode, "temperature": request.sampling.temperature,
        "max_tokens": request.max_tokens, "constrained": bool(request.grammar or request.json_schema),
        "prompt_tokens": stats.num_prompt_tokens, "completion_tokens": stats.num_generated_tokens}
    if conversation is None:
        entry.update(prompt=request.prompt, system_prompt=request.system_prompt,
                     use_chat_template=request.use_chat_template, text=text)
        return entry
    entry.update(messages=[message_dict(m) for m in conversation.messages],
                 tools=[tool.as_openai() for tool in conversation.tools],
                 tool_choice=conversation.tool_choice, parallel_tool_calls=conversation.parallel_tool_calls,
                 message=message_dict_of("assistant", content, calls))
    if reply is not None and reply.error:
        entry["reply_error"] = reply.error
    return entry


def message_dict(message: Any) -> Dict[str, Any]:
    """A chat layer's ChatMessage in OpenAI's shape (only the fields it has)."""
    out = message_dict_of(message.role, message.content, message.tool_calls)
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def message_dict_of(role: str, content: str, calls: Sequence[Any] = ()) -> Dict[str, Any]:
    """``{"role", "content"}``, with ``tool_calls`` in OpenAI's shape (arguments as JSON text)."""
    out: Dict[str, Any] = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return out


# -- reading ---------------------------------------------------------------------------------------
@dataclass
class ReadCounts:
    """What a read left out: torn last lines, and lines that are no record (damaged)."""

    torn: int = 0
    damaged: int = 0
    files: int = 0


def files_of(path: str) -> List[str]:
    """The files of the log at ``path`` that exist, oldest first (the rotated one, then the log)."""
    return [p for p in (path + ROTATED_SUFFIX, path) if os.path.lexists(p)]


def read_records(path: str, counts: Optional[ReadCounts] = None) -> Iterator[Dict[str, Any]]:
    """The records of the log at ``path`` and of its rotated file, oldest first, as dicts.

    A torn last line (a crash during a write) is skipped, as is a line that is not a record (counted
    in ``counts``). A file that is not the log's own raises :class:`ForeignLogError`; a missing log
    (no file at all) FileNotFoundError."""
    counts = counts if counts is not None else ReadCounts()
    files = files_of(path)
    if not files:
        raise FileNotFoundError(f"no request log at {path} (nor {path}{ROTATED_SUFFIX})")
    for file in files:
        check_own(file)
    for file in files:
        counts.files += 1
        yield from _read_file(file, counts)


def _read_file(file: str, counts: ReadCounts) -> Iterator[Dict[str, Any]]:
    fd = os.open(file, os.O_RDONLY | _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as stream:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or stream.read(len(HEADER)) != HEADER:
            raise ForeignLogError(f"{file} is not a request log written by gemma_spec_ros")
        for line in stream:
            if not line.endswith(b"\n"):
                counts.torn += 1
                return
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):
                counts.damaged += 1
                continue
            if not isinstance(entry, dict) or entry.get("kind") not in KINDS:
                counts.damaged += 1
                continue
            yield entry


__all__ = ["FINISHED", "FORMAT", "ForeignLogError", "HEADER", "ReadCounts", "RecordTooLargeError",
           "TrafficLog", "TrafficLogError", "VERSION", "check_own", "encode", "entry_of", "files_of",
           "open_log", "read_records", "resolve_path"]
