"""Read one string key from a GGUF file's header, without llama.cpp.

The kind of a draft model (a standalone model, or a Gemma 4 MTP assistant) decides how it is loaded:
an assistant's context needs the target's context at creation, so the kind must be known before
llama.cpp sees the file. Reading ``general.architecture`` from the header costs microseconds (it is
the first key llama.cpp's converters write); loading the model to ask would cost a load.

Format (GGUF v2/v3, little-endian): magic ``GGUF``, uint32 version, uint64 tensor count, uint64
key count, then each key: a string name, a uint32 value type and the value. A string is a uint64
length and that many UTF-8 bytes; an array is a uint32 element type, a uint64 count and the elements.
"""
from __future__ import annotations

import struct
from typing import BinaryIO, Optional

#: Byte sizes of the fixed-size value types (gguf value type ids 0..12; 8 string, 9 array).
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file, or its header is truncated."""


def _read(fh: BinaryIO, size: int) -> bytes:
    data = fh.read(size)
    if len(data) != size:
        raise GGUFHeaderError("truncated GGUF header")
    return data


def _read_string(fh: BinaryIO) -> bytes:
    (length,) = struct.unpack("<Q", _read(fh, 8))
    return _read(fh, length)


def _skip_value(fh: BinaryIO, value_type: int) -> None:
    if value_type == _STRING:
        _read_string(fh)
    elif value_type == _ARRAY:
        element_type, count = struct.unpack("<IQ", _read(fh, 12))
        if element_type in _FIXED_SIZES:
            fh.seek(_FIXED_SIZES[element_type] * count, 1)
        else:
            for _ in range(count):
                _skip_value(fh, element_type)
    elif value_type in _FIXED_SIZES:
        fh.seek(_FIXED_SIZES[value_type], 1)
    else:
        raise GGUFHeaderError(f"unknown GGUF value type {value_type}")


def read_string_key(path: str, key: str) -> Optional[str]:
    """The string value of ``key`` in the header of the GGUF file at ``path``; None if absent.

    Raises OSError if the file cannot be read, GGUFHeaderError if it is not a GGUF file.
    """
    wanted = key.encode()
    with open(path, "rb") as fh:
        if _read(fh, 4) != b"GGUF":
            raise GGUFHeaderError(f"not a GGUF file (bad magic): {path}")
        _version, _n_tensors, n_keys = struct.unpack("<IQQ", _read(fh, 20))
        for _ in range(n_keys):
            name = _read_string(fh)
            (value_type,) = struct.unpack("<I", _read(fh, 4))
            if name == wanted and value_type == _STRING:
                return _read_string(fh).decode("utf-8", errors="replace")
            _skip_value(fh, value_type)
    return None


def architecture(path: str) -> Optional[str]:
    """``general.architecture`` of a GGUF file (e.g. ``gemma3``, ``gemma4-assistant``)."""
    return read_string_key(path, "general.architecture")
