"""A `StepInput` (or any dataclass of `CLASSES`) as one flat byte buffer, so that a step reaches the worker processes
with one copy into shared memory and one copy out, and no pickling.

Layout: `[n_header int64][payload bytes int64][header: n_header int64][pad to 64][payload]`. The header walks the
dataclass fields in declaration order (both sides run the same code) and says for each one what it is:

    NONE                      None
    INT v | BOOL v | FLOAT b  a scalar (FLOAT: the IEEE-754 bits of a double)
    TENSOR dtype ndim *shape offset    the tensor's bytes at `offset` of the payload (64-byte aligned)
    LIST n offset             a list of ints, as int64 at `offset`
    OBJ class                 a nested dataclass, its fields follow

Decoding copies the payload once and makes every tensor a view into that copy (host tensors: `StepInput.to` then
moves them to the worker's device).
"""
from __future__ import annotations

import dataclasses
import struct

import torch

from m3serve.step_io import SamplerOutput, SamplingInput, SpeculativeInput, StepInput

CLASSES = (StepInput, SamplingInput, SamplerOutput, SpeculativeInput)
DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32, torch.float16,
          torch.bfloat16, torch.float64)
NONE, INT, BOOL, FLOAT, TENSOR, LIST, OBJ = range(7)
ALIGN = 64
PREFIX = 16  # the two int64 sizes before the header


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Encoded:
    """An object's header and the tensors its payload holds (not yet copied anywhere)."""

    def __init__(self, obj):
        self.header: list[int] = []
        self.parts: list[tuple[int, torch.Tensor]] = []  # (payload offset, contiguous host tensor)
        self.payload_bytes = 0
        self._object(obj)

    @property
    def header_bytes(self) -> int:
        return _aligned(PREFIX + 8 * len(self.header))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole message (prefix, header, payload)."""
        return self.header_bytes + self.payload_bytes

    def _add(self, t: torch.Tensor) -> int:
        off = self.payload_bytes
        self.parts.append((off, t))
        self.payload_bytes = _aligned(off + t.numel() * t.element_size())
        return off

    def _object(self, obj) -> None:
        self.header += [OBJ, CLASSES.index(type(obj))]
        for f in dataclasses.fields(obj):
            self._value(getattr(obj, f.name), f.name)

    def _value(self, v, name: str) -> None:
        h = self.header
        if v is None:
            h.append(NONE)
        elif isinstance(v, bool):
            h += [BOOL, int(v)]
        elif isinstance(v, int):
            h += [INT, v]
        elif isinstance(v, float):
            h += [FLOAT, struct.unpack("<q", struct.pack("<d", v))[0]]
        elif isinstance(v, torch.Tensor):
            if v.device.type != "cpu" or v.dtype not in DTYPES:
                raise TypeError(f"step field {name}: a {v.dtype} tensor on {v.device} cannot be sent (host "
                                f"tensors of {[str(d) for d in DTYPES]} only)")
            t = v.detach().contiguous()
            h += [TENSOR, DTYPES.index(t.dtype), t.dim(), *t.shape]
            h.append(self._add(t))
        elif isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            h += [LIST, len(v), self._add(torch.tensor(v, dtype=torch.int64))]
        elif dataclasses.is_dataclass(v) and type(v) in CLASSES:
            self._object(v)
        else:
            raise TypeError(f"step field {name}: {type(v).__name__} cannot be sent")

    def write_into(self, buf: torch.Tensor) -> None:
        """Write the message at the start of `buf` (uint8, at least `nbytes` long)."""
        hdr = torch.tensor([len(self.header), self.payload_bytes] + self.header, dtype=torch.int64)
        buf[:hdr.numel() * 8].copy_(hdr.view(torch.uint8))
        base = self.header_bytes
        for off, t in self.parts:
            n = t.numel() * t.element_size()
            if n:
                buf[base + off: base + off + n].copy_(t.reshape(-1).view(torch.uint8))


def encode(obj) -> Encoded:
    return Encoded(obj)


def decode(buf: torch.Tensor):
    """The object a message at the start of `buf` (uint8) holds; its tensors view one private copy of the payload."""
    n_header, payload_bytes = (int(x) for x in buf[:PREFIX].view(torch.int64))
    header = buf[PREFIX: PREFIX + 8 * n_header].clone().view(torch.int64).tolist()
    start = _aligned(PREFIX + 8 * n_header)
    payload = buf[start: start + payload_bytes].clone()
    obj, end = _read_object(header, 0, payload)
    if end != len(header):
        raise ValueError(f"step message: {len(header) - end} header words left over (sender and receiver differ?)")
    return obj


def _read_object(h: list[int], i: int, payload: torch.Tensor):
    if h[i] != OBJ:
        raise ValueError(f"step message: expected an object at header word {i}, found kind {h[i]}")
    cls = CLASSES[h[i + 1]]
    i += 2
    values = {}
    for f in dataclasses.fields(cls):
        values[f.name], i = _read_value(h, i, payload)
    return cls(**values), i


def _read_value(h: list[int], i: int, payload: torch.Tensor):
    kind = h[i]
    if kind == NONE:
        return None, i + 1
    if kind == BOOL:
        return bool(h[i + 1]), i + 2
    if kind == INT:
        return h[i + 1], i + 2
    if kind == FLOAT:
        return struct.unpack("<d", struct.pack("<q", h[i + 1]))[0], i + 2
    if kind == TENSOR:
        dtype, ndim = DTYPES[h[i + 1]], h[i + 2]
        shape = h[i + 3: i + 3 + ndim]
        off = h[i + 3 + ndim]
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return payload[off: off + nbytes].view(dtype).view(shape), i + 4 + ndim
    if kind == LIST:
        n, off = h[i + 1], h[i + 2]
        return payload[off: off + 8 * n].view(torch.int64).tolist(), i + 3
    if kind == OBJ:
        return _read_object(h, i, payload)
    raise ValueError(f"step message: unknown field kind {kind} at header word {i}")
