"""The wire format between judge and candidate: plain-data values and length-prefixed JSON.

Runs inside both sandbox subprocesses (its source is prepended to theirs), so
it imports nothing from reinforge. The candidate encodes with it, the judge
decodes strictly with it: a decoded value is always a fresh object of an
exact builtin type, so nothing the candidate returns can carry behaviour
(`__eq__`, `__hash__`, `__len__`...) into the process that holds the tests.
"""

import json as _json
import os as _os

MAX_ITERATOR_ITEMS = 10**6  # an endless generator fails fast instead of running out the clock
# dict views cross as views of a fresh dict: `f() == {1, 2}` for `d.keys()` holds as in plain
# Python (keys and items views are set-like), and list(), len() and `in` work on them.
_VIEWS = ((type({}.keys()), "K"), (type({}.values()), "V"), (type({}.items()), "W"))
_REAL, _IMAG = complex.real, complex.imag  # the member descriptors, not a subclass's override


class ProtocolError(Exception):
    pass


def encode(x, depth=0):
    # The value a test would see in-process, read from the builtin base type's own slots
    # (`int.__int__`, `list.__iter__`, `dict.items`...) on the exact type: a subclass's
    # `__int__`, `__iter__` or `items`, or a `__class__` property claiming `int`, would
    # otherwise send a value the object does not compare equal to in plain Python.
    if depth > 200:
        raise TypeError("value nested too deeply")
    kind = type(x)
    if x is None:
        return ["N"]
    if kind is bool:
        return ["B", x is True]
    if issubclass(kind, int):
        return ["I", hex(int.__int__(x))]  # hex: str(int) is capped at 4300 digits
    if issubclass(kind, float):
        return ["F", float.hex(x)]  # exact, and covers inf and nan
    if issubclass(kind, complex):
        return ["C", float.hex(_REAL.__get__(x)), float.hex(_IMAG.__get__(x))]
    if issubclass(kind, str):
        return ["S", str.__str__(x)]
    if issubclass(kind, (bytes, bytearray)):
        base = bytes if issubclass(kind, bytes) else bytearray
        return ["Y", bytes(base.__getitem__(x, slice(None))).hex()]
    if kind is range:  # MBPP-style tests pass ranges: f(range(10))
        return ["R", hex(x.start), hex(x.stop), hex(x.step)]
    for base, tag in ((tuple, "T"), (list, "L"), (frozenset, "Z"), (set, "E")):
        if issubclass(kind, base):
            return [tag, [encode(v, depth + 1) for v in base.__iter__(x)]]
    if issubclass(kind, dict):
        return ["D", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(x)]]
    for view, tag in _VIEWS:
        if kind is view:  # views cannot be subclassed; their items are encoded like any value
            return [tag, [encode(v, depth + 1) for v in x]]
    if hasattr(kind, "__next__") and hasattr(kind, "__iter__"):
        # An iterator (a generator entry point, map, zip...) crosses as the items it yields,
        # and is an iterator again on the other side: `list(gen(3)) == [0, 1, 2]` holds.
        items = []
        for v in x:
            if len(items) >= MAX_ITERATOR_ITEMS:
                raise TypeError(f"an iterator of over {MAX_ITERATOR_ITEMS} items cannot cross")
            items.append(encode(v, depth + 1))
        return ["G", items]
    raise TypeError(f"a {kind.__name__} cannot cross the sandbox boundary (plain data only)")


def decode(x):
    # Strict: anything unexpected is a protocol error, never code.
    if type(x) is not list or not x or type(x[0]) is not str:
        raise ProtocolError("bad value")
    tag, rest = x[0], x[1:]
    try:
        if tag == "N" and not rest:
            return None
        if tag == "B" and type(rest[0]) is bool:
            return rest[0]
        if tag == "I" and type(rest[0]) is str:
            return int(rest[0], 16)
        if tag == "F" and type(rest[0]) is str:
            return float.fromhex(rest[0])
        if tag == "C" and type(rest[0]) is str and type(rest[1]) is str:
            return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
        if tag == "S" and type(rest[0]) is str:
            return rest[0]
        if tag == "Y" and type(rest[0]) is str:
            return bytes.fromhex(rest[0])
        if tag == "R" and len(rest) == 3 and all(type(v) is str for v in rest):
            return range(int(rest[0], 16), int(rest[1], 16), int(rest[2], 16))
        if tag in ("T", "L", "Z", "E", "G") and type(rest[0]) is list:
            items = [decode(v) for v in rest[0]]
            return {"T": tuple, "L": list, "Z": frozenset, "E": set, "G": iter}[tag](items)
        if tag == "D" and type(rest[0]) is list:
            return {decode(k): decode(v) for k, v in rest[0]}
        if tag == "K" and type(rest[0]) is list:
            return dict.fromkeys(decode(v) for v in rest[0]).keys()
        if tag == "V" and type(rest[0]) is list:
            return dict(enumerate(decode(v) for v in rest[0])).values()
        if tag == "W" and type(rest[0]) is list:
            pairs = [decode(v) for v in rest[0]]
            if not all(type(p) is tuple and len(p) == 2 for p in pairs):
                raise ProtocolError("bad W value: not (key, value) pairs")
            return dict(pairs).items()
    except (IndexError, TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad {tag} value: {exc}") from None
    raise ProtocolError(f"bad tag {tag!r}")


def send(fd, obj):
    data = _json.dumps(obj).encode()
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[_os.write(fd, data):]


def recv(fd, limit):
    def exactly(n):
        chunks, left = [], n
        while left:
            chunk = _os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError("peer closed the pipe")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    size = int.from_bytes(exactly(8), "big")
    if size > limit:
        raise ProtocolError(f"message of {size} bytes is over the {limit} byte limit")
    try:
        return _json.loads(exactly(size))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad message: {exc}") from None
