"""The pipe between the grader and a student's process: plain data only, and handles for the rest.

Both ends of the pipe run this file: the grader (which holds the checks and the reference answers)
and the student's process (which holds the student's code and nothing of the instructor's). A
message is a 4-byte length and a JSON object. Values cross the pipe as *plain data*:

    None, bool, int, float, complex, str, bytes, Fraction      by value, as their exact built-in type
    list, tuple, dict, set                                     by value, element by element
    NumPy arrays (numeric, bool, str) and NumPy scalars        by value: dtype, shape and raw bytes
    frozen/plain dataclasses defined in refimpl (e.g. Action)  by value: their fields, rebuilt by refimpl's class
    generators, iterators, ranges, dict views                  as the list of what they yield

Anything else (a Tensor of the check's graph, a ring link, an optimizer, a class the student
wrote) crosses as a *handle*: the receiving side gets a `Remote`, and using it (an attribute, a
call) asks the owner to do it and send the plain result back. A handle sent back to its owner is
the owner's original object again, so identity survives a round trip (a check can ask "is this the
graph's node?").

Why not pickle: unpickling runs code chosen by whoever wrote the bytes. The grader never unpickles
what the student's process sends, and decoding here constructs only built-in types, NumPy arrays
from raw bytes, and refimpl's own dataclasses from decoded fields. A student's object never exists
in the grader's process: at most a `Remote` to it, whose comparisons are identity (a student's
`__eq__` cannot answer a check's `==`).

What the owner allows. `Peer(..., trusted=False)` is the grader's side: the student's process may
read attributes whose names do not start with "_" (no `__globals__`, `__dict__`, `__code__`), may
set only the attributes a check hands out to write (`grad`, and names in a class's
`student_writable`), and may call what it holds a handle to. The student's side trusts the
grader.

Arguments are passed by value and written back: after a call, the callee sends the arguments'
final state and the caller copies it into its own arrays, lists and dicts, so that a function that
updates an optimizer state dict in place behaves as in one process. Mirrored arrays: both sides
keep each call's argument arrays by call id, so an argument array that a reply hands back (a ring
link's `exchange` returns its receive buffer) arrives as the caller's own object, with its current
values; `push()` later copies what the callee wrote into its copy (a message delivered) to the
caller's array, and `arguments(call)` fetches a call's arguments' final values (a generator's
buffer when it ends).
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import itertools
import json
import struct
import threading
import time
import types
from fractions import Fraction

import numpy as np

MAX_MESSAGE = 256 << 20  # bytes of one message from a student's process (a returned array is a few MB at most)
WRITABLE = frozenset({"grad"})  # attributes the student's process may set on the grader's objects
_ITERATORS = (range, map, filter, zip, enumerate, reversed, type({}.keys()),
              type({}.values()), type({}.items()), type(iter([])), type(iter(())), itertools.chain)


class RemoteError(Exception):
    """The other side raised: `kind` is its exception's type name, `text` its message."""

    def __init__(self, kind: str, text: str, where: str = "") -> None:
        super().__init__(f"{kind}: {text}" if text else kind)
        self.kind, self.text, self.where = kind, text, where


class PeerGone(BaseException):  # noqa: N818 - a BaseException: a check's `except Exception` must not swallow it
    """The other process closed the pipe (it exited or was killed)."""


class OutOfTime(BaseException):  # noqa: N818 - the same reason
    """The exercise's time ran out while waiting for the other process."""


class Remote:
    """An object that lives in the other process; attribute reads and calls go through the pipe."""

    __slots__ = ("_peer", "_id", "_kind", "_origin", "__weakref__")

    def __init__(self, peer: Peer, ident: int, kind: str) -> None:
        object.__setattr__(self, "_peer", peer)
        object.__setattr__(self, "_id", ident)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_origin", None)  # the call that returned it (a generator: its arguments)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return self._peer.request({"op": "getattr", "target": self._id, "name": name})

    def __setattr__(self, name: str, value) -> None:
        self._peer.request({"op": "setattr", "target": self._id, "name": name, "value": self._peer.encode(value)})

    def __call__(self, *args, **kwargs):
        return self._peer.call(self._id, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self._kind} in the other process>"


def _refimpl_type(name: str):
    """The refimpl class `name` names ("refimpl.autograd.tensor:Tensor"), or None."""
    module, _, qualname = name.partition(":")
    if module.split(".")[0] != "refimpl" or "." in qualname:
        return None
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except Exception:  # noqa: BLE001 - not importable here: a plain Remote
        return None
    return cls if isinstance(cls, type) else None


_POSING: dict[type, type] = {}


def _posing_as(cls: type) -> type:
    """A Remote that `isinstance` counts as a `cls` (refimpl's Tensor, Function...): the student's side
    only, for the grader's objects, so that a student's `isinstance(t, Tensor)` works on the check's graph."""
    if cls not in _POSING:
        _POSING[cls] = type(f"Remote{cls.__name__}", (Remote,), {"__slots__": (),
                                                                  "__class__": property(lambda self: cls)})
    return _POSING[cls]


def _dataclass_name(value) -> str | None:
    cls = type(value)
    if dataclasses.is_dataclass(cls) and cls.__module__.split(".")[0] == "refimpl":
        return f"{cls.__module__}:{cls.__qualname__}"
    return None


def _refimpl_class(name: str):
    module, _, qualname = name.partition(":")
    if module.split(".")[0] != "refimpl" or "." in qualname:
        raise ValueError(f"not a refimpl dataclass: {name}")
    cls = getattr(importlib.import_module(module), qualname)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"not a refimpl dataclass: {name}")
    return cls


class Peer:
    """One end of the pipe: sends requests, answers the other end's, keeps the handles it gave out."""

    def __init__(self, reader, writer, *, trusted: bool, on_request=None, first=None) -> None:
        self.reader, self.writer, self.trusted = reader, writer, trusted
        self.objects: dict[int, object] = {}  # handles this side gave out: id -> object
        self.handle_of: dict[int, int] = {}  # id(object) -> handle
        self.remotes: dict[int, Remote] = {}  # the other side's handles, one Remote each (identity)
        self.pending: dict[int, list] = {}  # request id -> [Event, reply]
        self.lock = threading.Lock()
        self.counter = itertools.count(1)
        self.deadline: float | None = None  # monotonic time after which a wait raises OutOfTime
        self.gone = False
        self.on_request = on_request  # called with each request before it runs (the student side: tripwires)
        # Mirrored arrays: the arrays of each call's arguments, by call id, on both sides (the caller's
        # originals, the callee's decoded copies), so that an array a reply hands back (a receive buffer)
        # stays the same object on each side; push() copies the callee's changed copies to the caller.
        self.sent_args: dict[int, list] = {}
        self.served_args: dict[int, list] = {}
        self.mirror_of: dict[int, tuple] = {}  # id(array) -> ("sent" or "served", call id, index)
        self.mirrored: dict[tuple, bytes] = {}  # (call id, index) of served arrays handed back -> last pushed bytes
        self.replying = threading.local()
        if first is not None:
            self._handle(first)  # handle 1, before any request can arrive
        self.thread = threading.Thread(target=self._read_loop, daemon=True)
        self.thread.start()

    # -- values ----------------------------------------------------------------------------------

    def encode(self, value):
        """`value` as JSON-able plain data (handles for what is not plain)."""
        t = type(value)
        if value is None or t in (bool, str) or t is int or t is float:
            return value if t is not float or np.isfinite(value) else {"__f__": repr(value)}
        if isinstance(value, bool):
            return bool(value)
        if isinstance(value, int) and not isinstance(value, np.generic):
            return int(value)
        if isinstance(value, float) and not isinstance(value, np.generic):
            return self.encode(float(value))
        if isinstance(value, str):
            return str(value)
        if isinstance(value, complex):
            return {"__c__": [complex(value).real, complex(value).imag]}
        if isinstance(value, bytes):
            return {"__b__": base64.b64encode(bytes(value)).decode()}
        if isinstance(value, np.dtype):
            return {"__dt__": value.str if value.kind in "biufcUS" else "O"}
        if isinstance(value, Fraction):
            return {"__q__": [value.numerator, value.denominator]}
        if isinstance(value, Remote) and value._peer is self:
            return {"__ref__": value._id}  # the other side's object, going home
        if isinstance(value, np.generic) and value.dtype.kind in "biufcUS":
            return {"__s__": [value.dtype.str, base64.b64encode(np.asarray(value).tobytes()).decode()]}
        if isinstance(value, np.ndarray) and getattr(self.replying, "on", False):
            mirror = self.mirror_of.get(id(value))
            if mirror is not None and self._mirror_array(mirror) is value and value.dtype.kind in "biufcUS":
                role, call, index = mirror
                if role == "served":
                    self.mirrored.setdefault((call, index), b"")
                return {"__m__": [role, call, index], "a": self._plain_array(value)}
        if isinstance(value, np.ndarray):
            if value.dtype.kind in "biufcUS":
                array = np.ascontiguousarray(value).view(np.ndarray)
                return {"__a__": [array.dtype.str, list(array.shape), base64.b64encode(array.tobytes()).decode()]}
            return {"__oa__": [list(value.shape), [self.encode(v) for v in value.ravel().tolist()]]}
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"__t__": [self.encode(v) for v in value]}
        if isinstance(value, list):
            return [self.encode(v) for v in value]
        if isinstance(value, dict):
            return {"__d__": [[self.encode(k), self.encode(v)] for k, v in value.items()]}
        if isinstance(value, (set, frozenset)):
            return {"__set__": [self.encode(v) for v in value], "frozen": isinstance(value, frozenset)}
        name = _dataclass_name(value)
        if name is not None:
            fields = {f.name: self.encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
            return {"__dc__": name, "fields": fields}
        if isinstance(value, _ITERATORS):
            return [self.encode(v) for v in value]
        return self._handle(value)

    def _mirror_array(self, mirror: tuple):
        role, call, index = mirror
        arrays = (self.sent_args if role == "sent" else self.served_args).get(call, [])
        return arrays[index] if index < len(arrays) else None

    def _plain_array(self, value: np.ndarray) -> dict:
        array = np.ascontiguousarray(value).view(np.ndarray)
        return {"__a__": [array.dtype.str, list(array.shape), base64.b64encode(array.tobytes()).decode()]}

    def _register(self, role: str, call: int, tree) -> None:
        arrays = _arrays(tree)
        with self.lock:
            (self.sent_args if role == "sent" else self.served_args)[call] = arrays
            for index, array in enumerate(arrays):
                self.mirror_of[id(array)] = (role, call, index)

    def push(self) -> None:
        """Copy every served array this side handed back (a receive buffer) and changed since, to the
        caller's original: before the other side's code runs again."""
        changes = []
        for (call, index) in list(self.mirrored):
            array = self.served_args.get(call, [None] * (index + 1))[index]
            if isinstance(array, np.ndarray):
                now = array.tobytes()
                if now != self.mirrored[(call, index)]:
                    self.mirrored[(call, index)] = now
                    changes.append([call, index, self._plain_array(array)])
        if changes:
            self.request({"op": "sync", "arrays": changes})

    def arguments(self, call: int) -> None:
        """Copy the final state of the arguments of our call `call` (served over there) into ours."""
        self.request({"op": "args", "call": call})

    def _handle(self, value):
        key = id(value)
        with self.lock:
            if key not in self.handle_of or self.objects.get(self.handle_of[key]) is not value:
                ident = next(self.counter)
                self.handle_of[key], self.objects[ident] = ident, value
            ident = self.handle_of[key]
        kind = "class" if isinstance(value, type) else type(value).__name__
        cls = type(value)
        return {"__h__": ident, "kind": kind, "cls": f"{cls.__module__}:{cls.__qualname__}"}

    def decode(self, data):
        """The value `data` encodes: built-in types, arrays, refimpl dataclasses, Remotes."""
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        if isinstance(data, list):
            return [self.decode(v) for v in data]
        if not isinstance(data, dict) or len(data) > 3:
            raise ValueError("malformed message")
        if "__f__" in data:
            return float(data["__f__"])
        if "__c__" in data:
            return complex(*data["__c__"])
        if "__b__" in data:
            return base64.b64decode(data["__b__"])
        if "__dt__" in data:
            return _dtype(data["__dt__"])
        if "__q__" in data:
            return Fraction(int(data["__q__"][0]), int(data["__q__"][1]))
        if "__s__" in data:
            dtype, raw = data["__s__"]
            return np.frombuffer(base64.b64decode(raw), dtype=_dtype(dtype))[0]
        if "__a__" in data:
            dtype, shape, raw = data["__a__"]
            return np.frombuffer(base64.b64decode(raw), dtype=_dtype(dtype)).reshape(shape).copy()
        if "__oa__" in data:
            shape, items = data["__oa__"]
            array = np.empty(len(items), dtype=object)
            array[:] = [self.decode(v) for v in items]
            return array.reshape(shape)
        if "__m__" in data:
            role, call, index = data["__m__"]
            values = self.decode(data["a"])
            mine = (self.served_args if role == "sent" else self.sent_args).get(int(call), [])
            target = mine[int(index)] if 0 <= int(index) < len(mine) else None
            if not isinstance(target, np.ndarray) or not isinstance(values, np.ndarray) or \
                    target.shape != values.shape or not target.flags.writeable:
                return values
            target[...] = values
            return target
        if "__t__" in data:
            return tuple(self.decode(v) for v in data["__t__"])
        if "__d__" in data:
            return {_hashable(self.decode(k)): self.decode(v) for k, v in data["__d__"]}
        if "__set__" in data:
            items = [_hashable(self.decode(v)) for v in data["__set__"]]
            return frozenset(items) if data.get("frozen") else set(items)
        if "__dc__" in data:
            cls = _refimpl_class(data["__dc__"])
            return cls(**{k: self.decode(v) for k, v in data["fields"].items()})
        if "__ref__" in data:
            with self.lock:
                return self.objects[int(data["__ref__"])]
        if "__h__" in data:
            ident = int(data["__h__"])
            with self.lock:
                if ident not in self.remotes:
                    cls = _refimpl_type(str(data.get("cls", ""))) if self.trusted else None
                    kind = str(data.get("kind", "object"))[:60]
                    self.remotes[ident] = (Remote(self, ident, kind) if cls is None
                                           else _posing_as(cls)(self, ident, kind))
                return self.remotes[ident]
        raise ValueError("malformed message")

    # -- requests --------------------------------------------------------------------------------

    def call(self, target: int, args: tuple, kwargs: dict):
        """Call the other side's object `target`; copy the arguments' final state back into ours."""
        ident = next(self.counter)
        self._register("sent", ident, [list(args), dict(kwargs)])
        message = {"op": "call", "target": target, "args": self.encode(list(args)),
                   "kwargs": self.encode(dict(kwargs))}
        value, after = self.request(message, with_writeback=True, ident=ident)
        if after is not None:
            write_back(list(args), after[0])
            write_back(dict(kwargs), after[1])
        if isinstance(value, Remote):
            object.__setattr__(value, "_origin", ident)
        return value

    def request(self, message: dict, with_writeback: bool = False, ident: int | None = None):
        if self.gone:
            raise PeerGone("the other process has ended")
        ident = next(self.counter) if ident is None else ident
        slot = [threading.Event(), None]
        with self.lock:
            self.pending[ident] = slot
        self._send({**message, "id": ident})
        while not slot[0].wait(0.05):
            if self.gone:
                raise PeerGone("the other process has ended")
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise OutOfTime
        reply = slot[1]
        if not isinstance(reply, dict):
            raise RemoteError("MalformedReply", "the other process sent a reply that is not an object")
        if reply.get("gone"):
            raise PeerGone("the other process has ended")
        if "error" in reply:
            error = reply["error"]
            kind, text, where = (list(error) + ["", "", ""])[:3] if isinstance(error, list) else ("Error", error, "")
            if kind == "NotImplementedError":
                raise NotImplementedError(str(text)[:2000])
            raise RemoteError(str(kind)[:100], str(text)[:2000], str(where)[:200])
        try:
            value = self.decode(reply["value"])
            after = self.decode(reply["after"]) if with_writeback and reply.get("after") is not None else None
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as exc:
            raise RemoteError("MalformedReply", f"the other process sent a value this side cannot read ({exc})") \
                from None
        return (value, after) if with_writeback else value

    def notify(self, message: dict) -> None:
        """A one-way message (no reply): the student side's tripwire reports."""
        self._send({**message, "id": 0})

    def _send(self, message: dict) -> None:
        data = json.dumps(message).encode()
        with self.lock:
            try:
                self.writer.write(struct.pack("<I", len(data)) + data)
                self.writer.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.gone = True

    def _read_exactly(self, size: int) -> bytes:
        """`size` bytes, or fewer only at the end of the stream: an unbuffered pipe's read returns what
        has arrived so far, and a message larger than the pipe's buffer arrives in pieces."""
        pieces, left = [], size
        while left:
            piece = self.reader.read(left)
            if not piece:
                break
            pieces.append(piece)
            left -= len(piece)
        return b"".join(pieces)

    def _read_loop(self) -> None:
        try:
            while True:
                head = self._read_exactly(4)
                if len(head) < 4:
                    break
                (size,) = struct.unpack("<I", head)
                if not self.trusted and size > MAX_MESSAGE:
                    break  # a student's process that sends more than this is treated as gone (and stopped)
                message = json.loads(self._read_exactly(size))
                if not isinstance(message, dict):
                    break
                if "reply_to" in message:
                    with self.lock:
                        slot = self.pending.pop(message["reply_to"], None)
                    if slot is not None:
                        slot[1] = message
                        slot[0].set()
                elif message.get("op") == "note":
                    if self.on_request is not None:
                        self.on_request(message)
                else:
                    threading.Thread(target=self._serve, args=(message,), daemon=True).start()
        except (OSError, ValueError, struct.error, RecursionError, TypeError):
            pass
        self.gone = True
        with self.lock:
            slots = list(self.pending.values())
            self.pending.clear()
        for slot in slots:
            slot[1] = {"gone": True}
            slot[0].set()

    def _serve(self, message: dict) -> None:
        reply: dict = {"reply_to": message.get("id")}
        try:
            if self.on_request is not None:
                self.on_request(message)
            op = message.get("op")
            if op == "sync":  # the other side's copies of our arrays changed: take their values
                for call, index, raw in message["arrays"]:
                    arrays = self.sent_args.get(int(call), [])
                    values = self.decode(raw)
                    if 0 <= int(index) < len(arrays) and arrays[int(index)].shape == np.shape(values):
                        arrays[int(index)][...] = values
                reply["value"] = None
                self._send(reply)
                return
            if op == "args":  # the final state of the arguments of a call we served
                arrays = self.served_args.get(int(message["call"]), [])
                self.replying.on = True
                try:
                    reply["value"] = self.encode(list(arrays))
                finally:
                    self.replying.on = False
                self._send(reply)
                return
            with self.lock:
                target = self.objects[int(message["target"])]
            if op == "getattr":
                name = str(message["name"])
                if not self.trusted and name.startswith("_"):
                    raise AttributeError(f"{name}: the grader's objects show no private attributes")
                reply["value"] = self.encode(getattr(target, name))
            elif op == "setattr":
                name = str(message["name"])
                allowed = WRITABLE | set(getattr(type(target), "student_writable", ()))
                if not self.trusted and (name not in allowed or isinstance(target, (type, types.ModuleType))):
                    raise AttributeError(f"{name}: the grader lets a student's code set only {sorted(allowed)}")
                setattr(target, name, self.decode(message["value"]))
                reply["value"] = None
            elif op == "call":
                args, kwargs = self.decode(message["args"]), self.decode(message["kwargs"])
                if not isinstance(args, list) or not isinstance(kwargs, dict):
                    raise ValueError("malformed call")
                self._register("served", int(message.get("id") or 0), [args, kwargs])
                result = target(*args, **kwargs)
                self.replying.on = True  # an argument array handed back stays the caller's object
                try:
                    reply["value"] = self.encode(result)
                finally:
                    self.replying.on = False
                reply["after"] = self.encode([args, kwargs])
            else:
                raise ValueError(f"unknown request {op!r}")
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller, as a message
            reply.pop("value", None)
            reply.pop("after", None)
            reply["error"] = [type(exc).__name__, str(exc)[:2000], _where(exc)]
        try:
            self._send(reply)
        except (TypeError, ValueError) as exc:  # a value json cannot write
            self._send({"reply_to": message.get("id"), "error": ["TypeError", str(exc)[:500], ""]})

    def forget(self, keep: int | None = None) -> None:
        """Drop every handle given out (but `keep`) and every Remote held: between exercises."""
        with self.lock:
            kept = {keep: self.objects[keep]} if keep in self.objects else {}
            self.objects.clear()
            self.objects.update(kept)
            self.handle_of = {id(v): k for k, v in kept.items()}
            self.remotes.clear()
            self.sent_args.clear()
            self.served_args.clear()
            self.mirror_of.clear()
            self.mirrored.clear()


_LIBRARY = ("/refimpl/", "/harness/", "/grading/", "site-packages", "/lib/python", "<frozen")


def _arrays(tree) -> list:
    """The NumPy arrays in a tree of lists, tuples and dicts, in a fixed order (both sides agree)."""
    found, todo = [], [tree]
    while todo:
        value = todo.pop(0)
        if isinstance(value, np.ndarray):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            todo[:0] = list(value)
        elif isinstance(value, dict):
            todo[:0] = list(value.values())
    return found


def _where(exc: BaseException) -> str:
    """'file:line, in function' of the innermost frame of the student's own code (outside refimpl, the
    harness, the grader and the libraries), else of the innermost frame: for a message."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    if not frames:
        return ""
    own = [f for f in frames if not any(part in f.tb_frame.f_code.co_filename for part in _LIBRARY)]
    last = (own or frames)[-1]
    code = last.tb_frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{last.tb_lineno}, in {code.co_name}"


def _dtype(text: str) -> np.dtype:
    dtype = np.dtype(str(text))
    if dtype.kind not in "biufcUS":
        raise ValueError(f"dtype {text} does not cross the pipe")
    return dtype


def _hashable(value):
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def write_back(original, final) -> None:
    """Copy `final` (a decoded copy of `original` after a call) into `original`'s mutable parts."""
    if isinstance(original, np.ndarray) and isinstance(final, np.ndarray):
        if original.shape == final.shape and original.flags.writeable and not np.array_equal(original, final,
                                                                                            equal_nan=_nan_ok(final)):
            original[...] = final
        return
    if isinstance(original, list) and isinstance(final, list):
        if len(original) == len(final):
            for i, (a, b) in enumerate(zip(original, final)):
                if _mutable(a):
                    write_back(a, b)
                elif a is not b and not _same(a, b):
                    original[i] = b
        else:
            original[:] = final
        return
    if isinstance(original, tuple) and isinstance(final, tuple) and len(original) == len(final):
        for a, b in zip(original, final):
            write_back(a, b)
        return
    if isinstance(original, dict) and isinstance(final, dict):
        for key in list(original):
            if key not in final:
                del original[key]
        for key, value in final.items():
            if key in original and _mutable(original[key]):
                write_back(original[key], value)
            elif key not in original or not _same(original[key], value):
                original[key] = value


def _mutable(value) -> bool:
    return isinstance(value, (np.ndarray, list, dict, tuple))


def _same(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an odd __eq__ counts as different
        return False


def _nan_ok(array: np.ndarray) -> bool:
    return array.dtype.kind in "fc"


class _Plain(Peer):
    """Peer.encode/decode without a pipe: plain data only (a recorded table of answers)."""

    def __init__(self) -> None:  # noqa: D107 - no pipe, no thread
        self.lock = threading.Lock()
        self.objects, self.remotes = {}, {}
        self.sent_args, self.served_args, self.mirror_of, self.mirrored = {}, {}, {}, {}
        self.replying = threading.local()

    def decode(self, data):
        if isinstance(data, dict) and "__fn__" in data:
            return ("function", data["__fn__"], self.decode(data["cells"]))
        return super().decode(data)

    def _handle(self, value):
        if callable(value) and hasattr(value, "__qualname__"):  # a check's own function, as a table key:
            cells = [c.cell_contents for c in (getattr(value, "__closure__", None) or ())]  # its name and what
            return {"__fn__": f"{value.__module__}.{value.__qualname__}",  # it closes over tell it apart
                    "cells": self.encode([cells, list(getattr(value, "__defaults__", None) or ())])}
        raise TypeError(f"{type(value).__name__} is not plain data")


def canonical(value) -> str:
    """`value` as one JSON string, equal for equal plain data (a table key)."""
    return json.dumps(_Plain().encode(value), sort_keys=True)


def from_canonical(text: str):
    return _Plain().decode(json.loads(text))
