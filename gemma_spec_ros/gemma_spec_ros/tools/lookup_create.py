"""``gemma-spec-lookup-create``: build a static n-gram cache from text files.

    gemma-spec-lookup-create CORPUS... -o cache.bin --model MODEL.gguf [--ngram-min 2 --ngram-max 2]

The same file as llama.cpp's ``llama-lookup-create -m MODEL -f CORPUS -lcs cache.bin``: each
corpus file is read as bytes, one trailing newline dropped (as llama.cpp's ``-f`` does), tokenized
with the model's own tokenizer (BOS added, special tokens parsed) and its 2-grams
(LLAMA_NGRAM_STATIC) counted. Several files add up; n-grams never span two files.
Give the result to the node as ``lookup.static_path`` (or llama.cpp's ``--lookup-cache-static``).

``--learned --ngram-min 1 --ngram-max 4`` makes a file to seed the node's *learned* cache
(``lookup.dynamic_path``) instead: the drafter reads only 2-grams from a static cache, and the node
reads or replaces a learned cache only in its own format (a header naming the vocabulary).

The cache is only valid with models that share MODEL's vocabulary (a Gemma 3 tokenizer, say).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from tqdm import tqdm

from ..engine.drafters import learned_cache
from ..engine.llama.vocab import vocab_tag_of
from ..engine.drafters.ngram_cache import NGRAM_MAX, NGRAM_STATIC, NgramCache
from ..engine.errors import CacheFormatError, ModelLoadError

PROG = "gemma-spec-lookup-create"
#: Tokens hashed between two progress-bar updates.
_PROGRESS_CHUNK = 1 << 16


class _VocabTokenizer:
    """A GGUF's tokenizer alone (llama.cpp ``vocab_only``: no weights loaded, milliseconds)."""

    def __init__(self, model_path: str) -> None:
        import llama_cpp  # here, so that --help works without the native library

        self._llama_cpp = llama_cpp
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
        if not self._model:
            raise ModelLoadError(f"cannot load the tokenizer of {model_path}: not a GGUF model?")
        self.vocab = llama_cpp.llama_model_get_vocab(self._model)

    def tokenize(self, text: bytes) -> List[int]:
        """``text`` as tokens, BOS added and special tokens parsed (llama.cpp's common_tokenize)."""
        capacity = len(text) + 8  # at most one token per byte, plus BOS/EOS
        while True:
            buffer = (self._llama_cpp.llama_token * capacity)()
            count = self._llama_cpp.llama_tokenize(self.vocab, text, len(text), buffer, capacity,
                                                   True, True)
            if count >= 0:
                return list(buffer[:count])
            if -count <= capacity:  # a negative count is the capacity needed; anything else fails
                raise RuntimeError(f"llama_tokenize failed ({count})")
            capacity = -count

    def close(self) -> None:
        if self._model:
            self._llama_cpp.llama_model_free(self._model)
            self._model = ctypes.c_void_p()

    def __enter__(self) -> "_VocabTokenizer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def tokenize_texts(model_path: str, texts: Sequence[bytes]) -> List[List[int]]:
    """Each text as the tokens this tool counts n-grams of (BOS added, special tokens parsed)."""
    with _VocabTokenizer(model_path) as tokenizer:
        return [tokenizer.tokenize(text) for text in texts]


def _read_corpus(path: Path) -> bytes:
    """The file's bytes less one trailing newline, as llama.cpp's ``-f`` reads a prompt file."""
    data = path.read_bytes()
    return data[:-1] if data.endswith(b"\n") else data


def build_static_cache(corpus_paths: Sequence[Path], tokenizer: "_VocabTokenizer",
                       ngram_min: int = NGRAM_STATIC, ngram_max: int = NGRAM_STATIC,
                       show_progress: bool = True) -> NgramCache:
    """The n-gram cache of the corpus files (each tokenized on its own)."""
    cache = NgramCache()
    with tqdm(total=len(corpus_paths), unit="file", disable=not show_progress,
              desc="tokenizing") as files_bar:
        token_lists = []
        for path in corpus_paths:
            token_lists.append(tokenizer.tokenize(_read_corpus(path)))
            files_bar.update()
    total_tokens = sum(len(tokens) for tokens in token_lists)
    with tqdm(total=total_tokens, unit="tok", unit_scale=True, disable=not show_progress,
              desc="counting n-grams") as tokens_bar:
        for tokens in token_lists:
            for start in range(0, len(tokens), _PROGRESS_CHUNK):
                stop = min(start + _PROGRESS_CHUNK, len(tokens))
                cache.update(tokens, ngram_min, ngram_max, start_index=start, stop_index=stop)
                tokens_bar.update(stop - start)
    return cache


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Build a static n-gram lookup cache (llama.cpp's file format) from text "
                    "files, tokenized with a model's tokenizer.")
    parser.add_argument("corpus", nargs="+", type=Path, help="text files to learn n-grams from")
    parser.add_argument("-o", "--output", required=True, type=Path,
                        help="cache file to write (replaced atomically)")
    parser.add_argument("-m", "--model", required=True,
                        help="GGUF model whose tokenizer to use (the target model, or any model "
                             "with the same vocabulary)")
    parser.add_argument("--ngram-min", type=int, default=NGRAM_STATIC,
                        help=f"shortest n-gram counted (default {NGRAM_STATIC}, as llama.cpp)")
    parser.add_argument("--ngram-max", type=int, default=NGRAM_STATIC,
                        help=f"longest n-gram counted (default {NGRAM_STATIC}, "
                             f"at most {NGRAM_MAX})")
    parser.add_argument("--learned", action="store_true",
                        help="write the node's learned-cache format (header + MODEL's vocabulary), "
                             "to seed lookup.dynamic_path; default: llama.cpp's plain format")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    args = parser.parse_args(argv)
    if not 1 <= args.ngram_min <= args.ngram_max <= NGRAM_MAX:
        parser.error(f"n-gram sizes {args.ngram_min}..{args.ngram_max}: "
                     f"need 1 <= --ngram-min <= --ngram-max <= {NGRAM_MAX}")
    for path in args.corpus:
        if not path.is_file():
            parser.error(f"corpus file not found: {path}" if not path.exists()
                         else f"corpus is not a file: {path}")
    model = Path(os.path.expandvars(os.path.expanduser(args.model)))
    if not model.is_file():
        parser.error(f"model file not found: {model}")
    args.model = str(model)
    if not args.output.parent.is_dir():
        parser.error(f"output directory does not exist: {args.output.parent}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 model or write failure, 2 usage)."""
    args = _parse_args(argv)
    # llama-cpp-python prints llama.cpp's log through this logger; keep the tool's output readable.
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if args.verbose else logging.ERROR)
    try:
        with _VocabTokenizer(args.model) as tokenizer:
            cache = build_static_cache(args.corpus, tokenizer, args.ngram_min, args.ngram_max,
                                       show_progress=not args.quiet)
            tag = vocab_tag_of(tokenizer.vocab) if args.learned else ""
    except ModelLoadError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 1
    try:
        if args.learned:
            learned_cache.save(cache, args.output, tag)
        else:
            cache.save(args.output)
    except (OSError, ValueError, CacheFormatError) as error:
        print(f"{PROG}: cannot write {args.output}: {error}", file=sys.stderr)
        return 1
    print(f"{PROG}: {len(cache)} n-grams of size {args.ngram_min}..{args.ngram_max} "
          f"({cache.total_count} counts) from {len(args.corpus)} file(s) -> {args.output} "
          f"({args.output.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
