"""Small Python values between ranks without pickle: JSON plus raw tensor bytes.

``Communicator.bcast_obj`` and ``allgather_obj`` travel this way, so no rank ever unpickles
bytes a peer sent (unpickling runs code the sender chose). A message is one uint8 tensor with
a fixed layout::

    8 bytes   little-endian length J of the header
    J bytes   UTF-8 JSON header: the value, with tensors/bytes replaced by references
    the rest  the raw bytes of the tensors and bytes objects, in the order referenced

and it moves through the communicator's own ``broadcast``/``allgather`` (its length first).
Plain JSON values pass as they are; tuples, dicts with non-string keys, ``bytes``, torch
tensors (CPU copies, put back on their device type), NumPy arrays and torch dtypes are
tagged so they come back as the same type. Dataclass instances travel as their fields and
come back as the receiver's own class where the receiver passed an instance at the same
place (``allgather_obj`` of a dataclass), else as a dict: no class is ever looked up by a
name a peer sent. Anything else is a ``TypeError`` that says what to send instead.

    >>> import torch
    >>> from commopt.comm.objects import decode, encode
    >>> decode(encode({"step": 3, "shape": (2, 2), 0: b"id", "w": torch.ones(2)}))
    {'step': 3, 'shape': (2, 2), 0: b'id', 'w': tensor([1., 1.])}
    >>> encode({1, 2})
    Traceback (most recent call last):
    ...
    TypeError: cannot send set at obj: bcast_obj/allgather_obj carry JSON values (None, bool, int, float, str, list, dict), tuples, bytes, tensors, NumPy arrays, torch dtypes and dataclasses of those, never pickle. Send a list instead (sorted(...)).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from typing import Any

import torch

_HEADER = struct.Struct("<Q")
_ALLOWED = (
    "JSON values (None, bool, int, float, str, list, dict), tuples, bytes, tensors, "
    "NumPy arrays, torch dtypes and dataclasses of those, never pickle"
)
_DTYPES = {
    str(d).replace("torch.", ""): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
        *(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)),
    )
}
# What to send instead of a few types people commonly try.
_HINTS = {
    "set": "a list instead (sorted(...))",
    "frozenset": "a list instead (sorted(...))",
    "Namespace": "a dict instead (vars(namespace))",
    "PosixPath": "a str instead (str(path))",
    "WindowsPath": "a str instead (str(path))",
    "device": "a str instead (str(device))",
    "Size": "a tuple instead (tuple(shape))",
}


class _Encoder:
    def __init__(self):
        self.blobs: list[bytes] = []
        self.offset = 0

    def _blob(self, data: bytes) -> list[int]:
        ref = [self.offset, len(data)]
        self.blobs.append(data)
        self.offset += len(data)
        return ref

    def value(self, obj: Any, where: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, (int, float)) and type(obj) in (int, float):
            return obj
        if isinstance(obj, list):
            return [self.value(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return {"$tuple": [self.value(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in obj):
                return {k: self.value(v, f"{where}[{k!r}]") for k, v in obj.items()}
            return {
                "$dict": [
                    [self.value(k, f"{where} key {k!r}"), self.value(v, f"{where}[{k!r}]")]
                    for k, v in obj.items()
                ]
            }
        if isinstance(obj, (bytes, bytearray)):
            return {"$bytes": self._blob(bytes(obj))}
        if isinstance(obj, torch.dtype):
            return {"$dtype": _dtype_name(obj, where)}
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return {
                "$tensor": [
                    _dtype_name(t.dtype, where),
                    list(t.shape),
                    obj.device.type,
                    *self._blob(data),
                ]
            }
        if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
            dtype, shape, _, off, n = self.value(torch.from_numpy(obj.copy()), where)["$tensor"]
            return {"$ndarray": [dtype, shape, off, n]}
        if type(obj).__module__ == "numpy" and hasattr(obj, "item"):  # NumPy scalars
            return self.value(obj.item(), where)
        if isinstance(obj, (int, float)):  # subclasses such as IntEnum
            return self.value(int(obj) if isinstance(obj, int) else float(obj), where)
        if type(obj) is torch.Size:
            return self.value(tuple(obj), where)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {
                "$dataclass": {
                    f.name: self.value(getattr(obj, f.name), f"{where}.{f.name}")
                    for f in dataclasses.fields(obj)
                }
            }
        name = type(obj).__name__
        raise TypeError(
            f"cannot send {name} at {where}: bcast_obj/allgather_obj carry {_ALLOWED}. "
            f"Send {_HINTS.get(name, 'its fields as a dict or list of those types')}."
        )


def _dtype_name(dtype: torch.dtype, where: str) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise TypeError(
            f"cannot send a tensor of dtype {dtype} at {where}: use one of {', '.join(_DTYPES)}"
        )
    return name


def encode(obj: Any) -> bytes:
    """The message for ``obj``: header length, JSON header, raw bytes."""
    enc = _Encoder()
    tree = enc.value(obj, "obj")
    header = json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()
    return b"".join([_HEADER.pack(len(header)), header, *enc.blobs])


def decode(message: bytes | memoryview, like: Any = None) -> Any:
    """The value ``encode`` made ``message`` from. Never runs code from the message.

    A dataclass instance comes back as an instance of the class found at the same place in
    ``like`` (the receiver's own value: the message never names a class), else as a dict.
    The message is a peer's bytes, so it is checked as it is read: anything ``encode`` could
    not have written raises ``ValueError`` saying what is wrong, never another error.

        >>> decode(b"\\x04\\0\\0\\0\\0\\0\\0\\0[1,2")
        Traceback (most recent call last):
        ...
        ValueError: malformed object message from a peer: its header is not JSON (...)...
    """
    message = memoryview(message)
    if len(message) < _HEADER.size:
        raise ValueError(f"object message of {len(message)} bytes is shorter than its header")
    (n,) = _HEADER.unpack(message[: _HEADER.size])
    start = _HEADER.size + n
    if start > len(message):
        raise ValueError(f"object message header says {n} bytes but only {len(message)} arrived")
    try:
        tree = json.loads(bytes(message[_HEADER.size : start]).decode())
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError: ValueError
        raise _malformed(f"its header is not JSON ({type(err).__name__}: {err})") from None
    try:
        return _Decoder(message[start:]).value(tree, like)
    except RecursionError:
        raise _malformed("its value is nested too deeply") from None


def _malformed(what: str) -> ValueError:
    return ValueError(
        f"malformed object message from a peer: {what}. bcast_obj/allgather_obj read only what "
        "commopt's encode writes: every rank must run the same commopt version, and nothing "
        "else may use the communicator for its own messages."
    )


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _malformed(f"{what} must be a non-negative integer, got {value!r:.60}")
    return value


def _fields(body: Any, count: int, tag: str) -> list:
    if not isinstance(body, list) or len(body) != count:
        raise _malformed(f"{tag} needs a list of {count} fields, got {body!r:.60}")
    return body


class _Decoder:
    def __init__(self, blob: memoryview):
        self.blob = blob

    def _bytes(self, off: Any, n: Any) -> bytes:
        off, n = _int(off, "a byte offset"), _int(n, "a byte count")
        if off + n > len(self.blob):
            raise ValueError(f"object message refers to bytes {off}..{off + n} beyond its end")
        return bytes(self.blob[off : off + n])

    def _tensor(self, dtype: Any, shape: Any, off: Any, n: Any) -> torch.Tensor:
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ValueError(f"object message names unknown dtype {dtype!r:.60}")
        if not isinstance(shape, list):
            raise _malformed(f"a tensor's shape must be a list, got {shape!r:.60}")
        dims = [_int(s, "a tensor dimension") for s in shape]
        itemsize = torch.empty((), dtype=_DTYPES[dtype]).element_size()
        numel = 1
        for d in dims:
            numel *= d
        if numel * itemsize != _int(n, "a byte count"):
            raise _malformed(
                f"a {dtype} tensor of shape {dims} needs {numel * itemsize} bytes, not {n}"
            )
        raw = self._bytes(off, n)
        flat = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
        if _DTYPES[dtype] == torch.bool and bool((flat > 1).any()):
            raise _malformed("a bool tensor holds bytes other than 0 and 1")
        return flat.view(_DTYPES[dtype]).reshape(dims)

    def value(self, node: Any, like: Any = None) -> Any:
        if isinstance(node, list):
            return [self.value(v, _item(like, i)) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((tag, body),) = node.items()
            if tag == "$tuple":
                if not isinstance(body, list):
                    raise _malformed(f"$tuple needs a list, got {body!r:.60}")
                return tuple(self.value(v, _item(like, i)) for i, v in enumerate(body))
            if tag == "$dict":
                if not isinstance(body, list):
                    raise _malformed(f"$dict needs a list of pairs, got {body!r:.60}")
                out = {}
                for pair in body:
                    k, v = _fields(pair, 2, "a $dict item")
                    key = _hashable(self.value(k))
                    out[key] = self.value(v, like.get(key) if isinstance(like, dict) else None)
                return out
            if tag == "$dataclass":
                if not isinstance(body, dict):
                    raise _malformed(f"$dataclass needs an object of fields, got {body!r:.60}")
                fields = {k: self.value(v, getattr(like, k, None)) for k, v in body.items()}
                if (
                    dataclasses.is_dataclass(like)
                    and not isinstance(like, type)
                    and set(fields) == {f.name for f in dataclasses.fields(like) if f.init}
                ):
                    return type(like)(**fields)  # the receiver's class, never one the peer names
                return fields
            if tag == "$bytes":
                return self._bytes(*_fields(body, 2, "$bytes"))
            if tag == "$dtype":
                if not isinstance(body, str) or body not in _DTYPES:
                    raise ValueError(f"object message names unknown dtype {body!r:.60}")
                return _DTYPES[body]
            if tag == "$tensor":
                dtype, shape, device, off, n = _fields(body, 5, "$tensor")
                if not isinstance(device, str):
                    raise _malformed(f"a tensor's device must be a str, got {device!r:.60}")
                t = self._tensor(dtype, shape, off, n)
                return t.to(device) if device != "cpu" and _device_usable(device) else t
            if tag == "$ndarray":
                dtype, shape, off, n = _fields(body, 4, "$ndarray")
                t = self._tensor(dtype, shape, off, n)
                try:
                    return t.numpy()
                except TypeError:  # a dtype NumPy lacks (bfloat16): encode never writes one
                    raise _malformed(f"NumPy has no dtype {dtype}") from None
        return {
            k: self.value(v, like.get(k) if isinstance(like, dict) else None)
            for k, v in node.items()
        }


def _item(like: Any, i: int) -> Any:
    return like[i] if isinstance(like, (list, tuple)) and i < len(like) else None


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise _malformed(f"a dict key is a {type(key).__name__}, which cannot be a key") from None
    return key


#: device types a tensor may come back on (a peer's string names no other torch attribute).
_DEVICE_TYPES = ("cuda", "xpu", "mps")


def _device_usable(device: str) -> bool:
    if device not in _DEVICE_TYPES:
        return False
    mod = getattr(torch, device, None)
    return bool(mod is not None and getattr(mod, "is_available", lambda: False)())


# -- over a communicator ----------------------------------------------------------------------
# These call the backend primitives directly (not the public collectives), so COMMOPT_DEBUG's
# per-call check, which itself gathers objects, does not recurse.


def _as_tensor(data: bytes, device: str = "cpu") -> torch.Tensor:
    t = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    return t.to(device)


def _encode_or_none(obj: Any) -> tuple[bytes | None, TypeError | None]:
    try:
        return encode(obj), None
    except TypeError as exc:
        return None, exc


def broadcast_object(comm, obj: Any, root: int = 0, *, send: Callable[..., Any]) -> Any:
    """``obj`` of rank ``root`` on every rank (the root gets its own object back).

    ``send(buf, root)``: the communicator's own tensor broadcast (returns its Work).

    If the root cannot encode ``obj`` it still sends a length (-1), so every rank raises
    instead of the others waiting for bytes that never come.
    """
    device = getattr(comm, "object_device", "cpu")  # nccl process groups move CUDA tensors only
    data, error = _encode_or_none(obj) if comm.rank == root else (b"", None)
    size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=device)
    send(size, root).wait()
    n = int(size.item())
    if error is not None:
        raise error
    if n < 0:
        raise TypeError(
            f"rank {comm.rank}: bcast_obj: rank {root} could not send its object "
            f"(its own error says why)"
        )
    if comm.rank == root:
        assert data is not None  # n >= 0: the root encoded its object
        buf = _as_tensor(data, device)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=device)
    if n:
        send(buf, root).wait()
    return obj if comm.rank == root else decode(buf.cpu().numpy().tobytes(), like=obj)


def allgather_object(comm, obj: Any, *, gather: Callable[..., Any]) -> list:
    """Every rank's ``obj``, in rank order (every rank raises if one cannot send its own).

    ``gather(send, recv)``: the communicator's own tensor allgather (returns its Work).
    """
    device = getattr(comm, "object_device", "cpu")
    data, error = _encode_or_none(obj)
    mine = _as_tensor(data or b"", device)
    sizes = torch.zeros(comm.size, dtype=torch.int64, device=device)
    gather(
        torch.tensor([-1 if data is None else mine.numel()], dtype=torch.int64, device=device),
        sizes,
    ).wait()
    sizes = sizes.cpu()
    if error is not None:
        raise error
    bad = [r for r in range(comm.size) if sizes[r] < 0]
    if bad:
        raise TypeError(
            f"rank {comm.rank}: allgather_obj: ranks {bad} could not send their "
            f"objects (their own errors say why)"
        )
    width = int(sizes.max().item())
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    everyone = torch.empty(width * comm.size, dtype=torch.uint8, device=device)
    gather(padded, everyone).wait()
    rows = everyone.cpu().view(comm.size, width)
    return [decode(rows[r, : int(sizes[r])].numpy().tobytes(), like=obj) for r in range(comm.size)]
