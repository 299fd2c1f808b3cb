"""The few protobuf messages of the Tinker wire, read and written by hand (no generated code).

The SDK sends ``forward_backward`` as a ``ForwardBackwardRequest`` message and expects
``ForwardBackwardOutput`` and ``SampleResponse`` back as messages (``Accept: application/x-protobuf``);
every other route is JSON. Field numbers (from the SDK's public schema, ``tinker_public.proto``)::

    ForwardBackwardRequest  1 model_id str  2 seq_id int32  3 data Datum*  4 loss_fn str
                            5 loss_fn_config map<str, double>  6 forward_only bool
                            7 loss_fn_config_v2 map<str, {1 number double | 2 text str}>
    Datum                   1 model_input Chunk*  2 loss_fn_inputs map<str, Tensor>  3, 4 provenance spans
    Chunk                   1 encoded_text {1 tokens bytes(int32)} | 2 image | 3 dmel
    Tensor                  1 dense bytes | 2 sparse_csr {1 values, 2 crow_indices, 3 col_indices: bytes}
                            3 dtype enum  4 shape int64*
    ForwardBackwardOutput   1 loss_fn_output_type str  2 loss_fn_outputs ArrayRecord*  3 metrics map<str, double>
    ArrayRecord             1 type_tag str  2 fields map<str, BatchedTensor>  3 num_datums int64
    BatchedTensor           1 data bytes  2 offsets bytes(int64 byte offsets)  3 dtype enum  4 trailing_shape int64*
    SampleResponse          1 sequences SampledSequence*  2 prompt_logprobs bytes(float32, NaN: none)
                            4 prompt_cache_hit_tokens int32
    SampledSequence         1 stop_reason enum (0 stop, 1 length)  2 tokens bytes(int32)  3 logprobs bytes(float32)

Wire format: a field is a varint key ``number << 3 | wire_type`` then its value: 0 varint, 1 eight
bytes, 2 a varint length then that many bytes (strings, bytes, messages, packed repeated), 5 four bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "DTYPE_FLOAT32",
    "DTYPE_INT32",
    "DTYPE_INT64",
    "ProtoError",
    "RawTensor",
    "decode_forward_backward_request",
    "encode_forward_backward_output",
    "encode_sample_response",
]

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
_NUMPY = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


class ProtoError(ValueError):
    """A protobuf body that does not parse as the message the route takes."""


# ---------------------------------------------------------------- reading


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 10 bytes")


def _fields(buf: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of one message, in order."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
        elif wire == _LEN:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise ProtoError(f"field {number}: length {n} runs past the end of the message")
            value, pos = bytes(buf[pos : pos + n]), pos + n
        elif wire == _FIXED64:
            value, pos = bytes(buf[pos : pos + 8]), pos + 8
        elif wire == _FIXED32:
            value, pos = bytes(buf[pos : pos + 4]), pos + 4
        else:
            raise ProtoError(f"field {number}: unsupported wire type {wire}")
        if pos > len(buf):
            raise ProtoError(f"field {number}: truncated")
        out.append((number, wire, value))
    return out


def _signed(v: int) -> int:
    """A varint as a signed int64 (negative int32s are sign-extended to 64 bits on the wire)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _str(v: int | bytes, what: str) -> str:
    if not isinstance(v, bytes):
        raise ProtoError(f"{what} must be a string")
    try:
        return v.decode()
    except UnicodeDecodeError:
        raise ProtoError(f"{what} is not UTF-8") from None


def _bytes(v: int | bytes, what: str) -> bytes:
    if not isinstance(v, bytes):
        raise ProtoError(f"{what} must be bytes")
    return v


def _int(v: int | bytes, what: str) -> int:
    if not isinstance(v, int):
        raise ProtoError(f"{what} must be an integer")
    return _signed(v)


def _repeated_ints(values: list[tuple[int, int | bytes]], what: str) -> list[int]:
    out: list[int] = []
    for wire, v in values:
        if wire == _LEN:  # packed
            pos, buf = 0, _bytes(v, what)
            while pos < len(buf):
                x, pos = _varint(buf, pos)
                out.append(_signed(x))
        else:
            out.append(_int(v, what))
    return out


def _map_entry(buf: bytes) -> tuple[str, int, int | bytes | None]:
    key, wire, value = "", _LEN, None
    for number, w, v in _fields(buf):
        if number == 1:
            key = _str(v, "map key")
        elif number == 2:
            wire, value = w, v
    return key, wire, value


@dataclass
class RawTensor:
    """A ``Tensor`` message: dense values, or sparse CSR (absent entries are 0)."""

    dtype: int
    shape: list[int]
    dense: bytes | None = None
    values: bytes = b""
    crow_indices: bytes = b""
    col_indices: bytes = b""

    def to_numpy(self, what: str) -> np.ndarray:
        np_dtype = _NUMPY.get(self.dtype)
        if np_dtype is None:
            raise ProtoError(f"{what}: dtype {self.dtype} is not float32, int64 or int32")
        itemsize = np.dtype(np_dtype).itemsize
        if self.dense is not None:
            if len(self.dense) % itemsize:
                raise ProtoError(f"{what}: {len(self.dense)} bytes is not a whole number of values")
            arr = np.frombuffer(self.dense, dtype=np_dtype).copy()
            if self.shape:
                if int(np.prod(self.shape)) != arr.size:
                    raise ProtoError(f"{what}: shape {self.shape} does not hold {arr.size} values")
                arr = arr.reshape(self.shape)
            return arr
        if len(self.shape) != 2:
            raise ProtoError(f"{what}: a sparse CSR tensor needs a 2-D shape, got {self.shape}")
        values = np.frombuffer(self.values, dtype=np_dtype)
        crow = np.frombuffer(self.crow_indices, dtype=np.int64)
        col = np.frombuffer(self.col_indices, dtype=np.int64)
        rows, cols = self.shape
        if (
            len(crow) != rows + 1
            or len(col) != len(values)
            or (len(col) and (col.min() < 0 or col.max() >= cols))
        ):
            raise ProtoError(f"{what}: sparse CSR indices do not fit the shape {self.shape}")
        out = np.zeros((rows, cols), dtype=np_dtype)
        for r in range(rows):
            lo, hi = int(crow[r]), int(crow[r + 1])
            if not 0 <= lo <= hi <= len(values):
                raise ProtoError(f"{what}: sparse CSR row pointers are not increasing")
            out[r, col[lo:hi]] = values[lo:hi]
        return out


def _tensor(buf: bytes, what: str) -> RawTensor:
    t = RawTensor(dtype=0, shape=[])
    shape: list[tuple[int, int | bytes]] = []
    for number, wire, v in _fields(buf):
        if number == 1:
            t.dense = _bytes(v, what)
        elif number == 2:
            for n2, _, v2 in _fields(_bytes(v, what)):
                if n2 == 1:
                    t.values = _bytes(v2, what)
                elif n2 == 2:
                    t.crow_indices = _bytes(v2, what)
                elif n2 == 3:
                    t.col_indices = _bytes(v2, what)
        elif number == 3:
            t.dtype = _int(v, what)
        elif number == 4:
            shape.append((wire, v))
    t.shape = _repeated_ints(shape, what)
    if t.dense is None and not (t.values or t.crow_indices):
        t.dense = b""  # an empty dense tensor: proto3 leaves the empty bytes out
    return t


@dataclass
class RawDatum:
    tokens: list[int] = field(default_factory=list)
    loss_fn_inputs: dict[str, RawTensor] = field(default_factory=dict)


@dataclass
class RawForwardBackward:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    forward_only: bool = False
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    data: list[RawDatum] = field(default_factory=list)


def _datum(buf: bytes, i: int) -> RawDatum:
    d = RawDatum()
    for number, _, v in _fields(buf):
        if number == 1:
            for n2, _, v2 in _fields(_bytes(v, f"data[{i}].model_input")):
                if n2 != 1:
                    kind = {2: "image", 3: "audio (dmel)"}.get(n2, f"field {n2}")
                    raise ProtoError(
                        f"data[{i}].model_input: {kind} chunks are not supported; send token chunks"
                    )
                for n3, _, v3 in _fields(_bytes(v2, "encoded_text")):
                    if n3 == 1:
                        raw = _bytes(v3, "tokens")
                        if len(raw) % 4:
                            raise ProtoError(f"data[{i}].model_input: token bytes are not int32s")
                        d.tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
        elif number == 2:
            key, _, value = _map_entry(_bytes(v, "loss_fn_inputs"))
            d.loss_fn_inputs[key] = _tensor(
                _bytes(value if value is not None else b"", key), f"data[{i}].loss_fn_inputs[{key!r}]"
            )
    return d


def decode_forward_backward_request(body: bytes) -> RawForwardBackward:
    """A ``ForwardBackwardRequest`` message (module docstring); ProtoError when it does not parse."""
    r = RawForwardBackward()
    v2: dict[str, float | str] = {}
    for number, wire, v in _fields(body):
        if number == 1:
            r.model_id = _str(v, "model_id")
        elif number == 2:
            r.seq_id = _int(v, "seq_id")
        elif number == 3:
            r.data.append(_datum(_bytes(v, "data"), len(r.data)))
        elif number == 4:
            r.loss_fn = _str(v, "loss_fn")
        elif number == 5:
            key, w, value = _map_entry(_bytes(v, "loss_fn_config"))
            if w == _FIXED64 and isinstance(value, bytes):
                r.loss_fn_config[key] = struct.unpack("<d", value)[0]
        elif number == 6:
            r.forward_only = bool(_int(v, "forward_only"))
        elif number == 7:
            key, _, value = _map_entry(_bytes(v, "loss_fn_config_v2"))
            for n2, w2, v2v in _fields(value if isinstance(value, bytes) else b""):
                if n2 == 1 and w2 == _FIXED64 and isinstance(v2v, bytes):
                    v2[key] = struct.unpack("<d", v2v)[0]
                elif n2 == 2:
                    v2[key] = _str(v2v, f"loss_fn_config[{key!r}]")
        del wire
    r.loss_fn_config.update(v2)  # the SDK writes both maps; v2 also carries strings
    return r


# ---------------------------------------------------------------- writing


def _put_varint(out: bytearray, v: int) -> None:
    if v < 0:
        v += 1 << 64
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return


def _put_key(out: bytearray, number: int, wire: int) -> None:
    _put_varint(out, number << 3 | wire)


def _put_len(out: bytearray, number: int, payload: bytes) -> None:
    _put_key(out, number, _LEN)
    _put_varint(out, len(payload))
    out += payload


def _put_int(out: bytearray, number: int, v: int) -> None:
    if v:
        _put_key(out, number, _VARINT)
        _put_varint(out, v)


def _put_double(out: bytearray, number: int, v: float) -> None:
    _put_key(out, number, _FIXED64)
    out += struct.pack("<d", v)


def _batched(arrays: list[np.ndarray], dtype: int) -> bytes:
    np_dtype = _NUMPY[dtype]
    parts = [np.ascontiguousarray(a, dtype=np_dtype).tobytes() for a in arrays]
    offsets = np.cumsum([0, *map(len, parts)], dtype=np.int64)
    out = bytearray()
    _put_len(out, 1, b"".join(parts))
    _put_len(out, 2, offsets.tobytes())
    _put_int(out, 3, dtype)
    return bytes(out)


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float], type_tag: str = "ArrayRecord"
) -> bytes:
    """A ``ForwardBackwardOutput``: one record of 1-D float32 fields per datum, and the metrics."""
    record = bytearray()
    _put_len(record, 1, type_tag.encode())
    names = list(outputs[0]) if outputs else []
    for name in names:
        entry = bytearray()
        _put_len(entry, 1, name.encode())
        _put_len(entry, 2, _batched([o[name].reshape(-1) for o in outputs], DTYPE_FLOAT32))
        _put_len(record, 2, bytes(entry))
    _put_int(record, 3, len(outputs))
    out = bytearray()
    _put_len(out, 1, type_tag.encode())
    _put_len(out, 2, bytes(record))
    for key, value in metrics.items():
        entry = bytearray()
        _put_len(entry, 1, key.encode())
        _put_double(entry, 2, float(value))
        _put_len(out, 3, bytes(entry))
    return bytes(out)


def encode_sample_response(
    sequences: list[tuple[str, list[int], list[float] | None]],
    prompt_logprobs: list[float] | None = None,
    prompt_cache_hit_tokens: int = 0,
) -> bytes:
    """A ``SampleResponse``: per sequence (stop reason "stop" or "length", tokens, logprobs or None);
    ``prompt_logprobs`` with NaN where none was computed (the first token)."""
    out = bytearray()
    for stop_reason, tokens, logprobs in sequences:
        seq = bytearray()
        _put_int(seq, 1, 1 if stop_reason == "length" else 0)
        _put_len(seq, 2, np.asarray(tokens, dtype=np.int32).tobytes())
        if logprobs is not None:
            _put_len(seq, 3, np.asarray(logprobs, dtype=np.float32).tobytes())
        _put_len(out, 1, bytes(seq))
    if prompt_logprobs is not None:
        _put_len(out, 2, np.asarray(prompt_logprobs, dtype=np.float32).tobytes())
    _put_int(out, 4, prompt_cache_hit_tokens)
    return bytes(out)
