"""The engine's errors: each message is meant for a user or an operator."""
from __future__ import annotations


class EngineError(RuntimeError):
    """Base class of the engine's errors; the message is meant for a user or operator."""


class ModelLoadError(EngineError):
    """A model file is missing, unreadable, not a GGUF, or does not fit in memory."""


class VocabMismatchError(EngineError):
    """The draft model's vocabulary differs from the target's (llama.cpp's compatibility rule)."""


class PromptTooLongError(EngineError):
    """The prompt does not fit in the context after reserving room for ``max_tokens``."""


class CacheFormatError(EngineError):
    """An n-gram cache file is truncated or not in llama.cpp's n-gram cache format."""


class KVCacheError(EngineError):
    """llama.cpp refused to remove KV cells (rollback failed); the sequence state is unknown."""


class GrammarError(EngineError):
    """A grammar stopped the request: it admits no token here (:data:`DEAD_END`), or it needs more
    work per token than the grammar engine's limits allow (grammar/matcher.py PARSER_LIMITS)."""


DEAD_END = ("the grammar admits no token here: the text so far cannot be continued (a grammar with a "
            "dead end, or a character no token of the model's vocabulary can spell)")
