"""Correct programs pass the sandbox, with namespaces on and off: no false negatives.

Ordinary MBPP/HumanEval-style solutions and tests, chosen to touch what the
sandbox restricts (imports, files, recursion, printing, exceptions, values at
the edges of the codec).
"""

from __future__ import annotations

import pytest

from reinforge.verifiers.code import CodeResult, run_many

CORRECT: dict[str, tuple[str, str]] = {
    "math": (
        "import math\ndef hyp(a, b):\n    return math.hypot(a, b)\n",
        # math unimported in the tests: MBPP relies on the program's import.
        "assert abs(hyp(3, 4) - 5.0) < 1e-9\nassert hyp(0, 0) == 0\n"
        "assert math.isclose(hyp(1, 1), math.sqrt(2))\n"),
    "itertools": (
        "from itertools import permutations, combinations\n"
        "def count_perms(xs):\n    return len(set(permutations(xs)))\n"
        "def pairs(n):\n    return list(combinations(range(n), 2))\n",
        "assert count_perms([1, 1, 2]) == 3\nassert len(pairs(4)) == 6\n"
        "assert sorted(pairs(3)) == [(0, 1), (0, 2), (1, 2)]\n"),
    "collections": (
        "from collections import Counter, deque, defaultdict, namedtuple, OrderedDict\n"
        "Point = namedtuple('Point', 'x y')\n"
        "def top(s):\n    return Counter(s).most_common(1)[0][0]\n"
        "def groups(words):\n    d = defaultdict(list)\n    for w in words:\n"
        "        d[len(w)].append(w)\n    return dict(d)\n"
        "def rotate(xs, k):\n    q = deque(xs)\n    q.rotate(k)\n    return list(q)\n",
        "assert top('abracadabra') == 'a'\nassert groups(['a', 'bb', 'c']) == {1: ['a', 'c'], 2: ['bb']}\n"
        "assert rotate([1, 2, 3], 1) == [3, 1, 2]\n"),
    "recursion": (
        "import sys\nfrom functools import lru_cache\nsys.setrecursionlimit(5000)\n"
        "@lru_cache(maxsize=None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n",
        "assert fib(90) == 2880067194370816120\nassert depth(2000) == 2000\n"),
    "classes_internally": (
        "from dataclasses import dataclass, field\n@dataclass\nclass Stack:\n"
        "    items: list = field(default_factory=list)\n    def push(self, x):\n"
        "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
        "PAIRS = {')': '(', ']': '['}\n"
        "def balanced(s):\n    st = Stack()\n    for c in s:\n        if c in '([':\n"
        "            st.push(c)\n        elif c in PAIRS:\n            if not st.items or st.pop() != PAIRS[c]:\n"
        "                return False\n    return not st.items\n",
        "assert balanced('([])')\nassert not balanced('(]')\nassert balanced('') is True\n"),
    "own_temp_files": (
        "import os, tempfile, pathlib, shutil, json\n"
        "def roundtrip(data):\n    with tempfile.TemporaryDirectory() as d:\n"
        "        os.mkdir(os.path.join(d, 'sub'))\n        p = os.path.join(d, 'sub', 'x.json')\n"
        "        with open(p, 'w') as fh:\n            json.dump(data, fh)\n"
        "        shutil.copy(p, p + '.bak')\n        return json.loads(pathlib.Path(p + '.bak').read_text())\n"
        "def scratch(text):\n    with tempfile.NamedTemporaryFile('w+') as fh:\n"
        "        fh.write(text)\n        fh.seek(0)\n        return fh.read()\n"
        "def local(text):\n    open('local.txt', 'w').write(text)\n    out = open('local.txt').read()\n"
        "    os.remove('local.txt')\n    return out + str(len(os.listdir('.')))\n",
        "assert roundtrip({'a': [1, 2]}) == {'a': [1, 2]}\nassert scratch('hi') == 'hi'\n"
        "assert local('x') == 'x0'\n"),
    "printing": (
        "def loud(n):\n    for i in range(n):\n        print('line', i)\n    return n * 2\n",
        "assert loud(1000) == 2000\nassert loud(0) == 0\n"),
    "builtins_in_tests": (
        "def evens(xs):\n    return [x for x in xs if x % 2 == 0]\n"
        "def half(x):\n    return x / 2\n",
        "assert sorted(evens([4, 1, 2])) == [2, 4]\nassert len(evens(range(10))) == 5\n"
        "assert abs(half(3) - 1.5) < 1e-9\nassert max(evens([8, 3, 6])) == 8\n"),
    "heap_bisect_re": (
        "import heapq, bisect, re\n"
        "def smallest(xs, k):\n    return heapq.nsmallest(k, xs)\n"
        "def where(xs, x):\n    return bisect.bisect_left(xs, x)\n"
        "def words(s):\n    return re.findall(r'[a-z]+', s.lower())\n",
        "assert smallest([5, 1, 4, 2], 2) == [1, 2]\nassert where([1, 3, 5], 4) == 2\n"
        "assert words('Hi, there!') == ['hi', 'there']\n"),
    "fractions_decimal_dates": (
        "from fractions import Fraction\nfrom decimal import Decimal\nimport datetime, statistics\n"
        "def add_frac(a, b):\n    return str(Fraction(a) + Fraction(b))\n"
        "def money(a, b):\n    return str(Decimal(a) + Decimal(b))\n"
        "def year(s):\n    return datetime.datetime.strptime(s, '%Y-%m-%d').year\n"
        "def med(xs):\n    return statistics.median(xs)\n",
        "assert add_frac('1/2', '1/3') == '5/6'\nassert money('0.1', '0.2') == '0.3'\n"
        "assert year('2024-02-29') == 2024\nassert med([3, 1, 2]) == 2\n"),
    "test_helper_and_exceptions": (
        "def check(*a):\n    return True  # its own helper; the tests' check must win\n"
        "def abs(x):\n    return x if x >= 0 else -x  # used internally, correct anyway\n"
        "def parse(s):\n    if not s.isdigit():\n        raise ValueError(s)\n    return int(s)\n"
        "def dist(a, b):\n    return abs(a - b)\n"
        "LIMIT = 10\n",
        "def check(fn, arg, want):\n    return fn(arg) == want\n"
        "def raises(fn, arg):\n    try:\n        fn(arg)\n    except ValueError:\n        return True\n"
        "    return False\n"
        "assert check(parse, '12', 12)\nassert raises(parse, 'x')\nassert not check(parse, '3', 4)\n"
        "assert dist(2, 5) == 3\nassert LIMIT == 10\n"),
    "pathlib_and_relative_os_open": (
        "import os, pathlib, shutil\n"
        "def go():\n    d = pathlib.Path('data')\n    d.mkdir()\n    (d / 'a.txt').write_text('1')\n"
        "    (d / 'b.txt').touch()\n    names = sorted(p.name for p in d.glob('*.txt'))\n"
        "    (d / 'a.txt').rename(d / 'c.txt')\n    (d / 'b.txt').unlink()\n"
        "    os.makedirs('e/f', exist_ok=True)\n    shutil.rmtree('e')\n"
        "    fd = os.open('rel.txt', os.O_WRONLY | os.O_CREAT)\n    os.write(fd, b'hi')\n"
        "    os.close(fd)\n    return names + os.listdir(d) + [open('rel.txt').read()]\n",
        "assert go() == ['a.txt', 'b.txt', 'c.txt', 'hi']\n"),
    "strings_and_sets": (
        "def uniq(s):\n    return ''.join(sorted(set(s)))\ndef caesar(s, k):\n"
        "    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) for c in s)\n",
        "assert uniq('banana') == 'abn'\nassert caesar('xyz', 3) == 'abc'\n"),
    "stdlib_imports_lazy_and_eager": (
        "import re, json, fractions, decimal, heapq, bisect, functools, statistics, datetime\n"
        "import string, random, typing, dataclasses, enum, copy, operator, itertools\n"
        "import collections, math, cmath, numbers, textwrap, unicodedata, hashlib, array, struct\n"
        "def digest(s):\n    import hashlib, unicodedata, struct, array\n"
        "    return (hashlib.sha256(s.encode()).hexdigest()[:8], unicodedata.name('a'),\n"
        "            struct.pack('<i', 1), array.array('i', [1, 2]).tolist())\n"
        "def wrap(s):\n    import textwrap\n    return textwrap.shorten(s, 12)\n",
        "assert digest('abc') == ('ba7816bf', 'LATIN SMALL LETTER A', b'\\x01\\x00\\x00\\x00', [1, 2])\n"
        "assert wrap('hello world foo') == 'hello [...]'\n"),
    "clock_random_sys": (
        "import random, time, datetime, sys\n"
        "def same_draw(n):\n    random.seed(n)\n    a = random.randint(1, 100)\n"
        "    random.seed(n)\n    return a == random.randint(1, 100)\n"
        "def now_ok():\n    return (time.time() > 1e9 and datetime.date.today().year >= 2024\n"
        "            and sys.getsizeof([]) > 0 and isinstance(sys.argv, list))\n"
        "def stdin_text():\n    return sys.stdin.read()\n"
        "if __name__ == '__main__':\n    print(same_draw(1))\n",
        "assert same_draw(5) is True\nassert now_ok()\nassert stdin_text() == ''\n"),
    "entry_point_forms_and_recursion": (
        "import sys\nclass Solution:\n    def twice(self, x):\n        return 2 * x\n"
        "def twice(x):\n    return Solution().twice(x)\ntriple = lambda x: 3 * x\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n",
        "assert twice(2) == 4\nassert triple(2) == 6\nassert depth(900) == 900\n"),
    "numbers_at_the_edges": (
        "def inf_or_nan(x):\n    return float('inf') if x else float('nan')\n"
        "def neg_zero():\n    return -0.0\ndef power(n):\n    return 2 ** n\n"
        "def positive(x):\n    return x > 0\ndef root(x):\n    import cmath\n    return cmath.sqrt(x)\n",
        "import math\nassert math.isinf(inf_or_nan(1))\nassert math.isnan(inf_or_nan(0))\n"
        "assert math.copysign(1, neg_zero()) == -1 and neg_zero() == 0\n"
        "assert power(20000) == 2 ** 20000\nassert positive(1) is True and positive(1) == 1\n"
        "assert positive(-1) is False\nassert root(-1) == 1j\n"),
    "raised_errors_and_kwargs": (
        "def parse(x, base=10, *, strict=True):\n    if strict and not x.isdigit():\n"
        "        raise ValueError(x)\n    return int(x, base) if x.isdigit() else None\n"
        "def first(xs):\n    it = iter(xs)\n    try:\n        return next(it)\n"
        "    except StopIteration:\n        return None\n",
        "try:\n    parse('x')\n    raised = False\nexcept ValueError:\n    raised = True\n"
        "assert raised\nassert parse('11', 2) == 3\nassert parse('x', strict=False) is None\n"
        "assert first([]) is None and first([4]) == 4\n"),
    "containers_back_as_builtins": (
        "from collections import Counter, OrderedDict\nclass S(str):\n    pass\n"
        "def counts(s):\n    return Counter(s)\ndef ordered():\n    return OrderedDict(a=1)\n"
        "def name():\n    return S('abc')\ndef pair(x):\n    return {x, x + 1}, (x, x + 1)\n"
        "def total(r):\n    return sum(r)\n",
        "assert counts('aab') == {'a': 2, 'b': 1}\nassert ordered() == {'a': 1}\n"
        "assert name() == 'abc' and isinstance(name(), str)\n"
        "assert pair(1) == ({1, 2}, (1, 2))\nassert total(range(10)) == 45\n"),
    "exceptions_as_in_plain_python": (
        "import sys\ndef parse(s):\n    if not s.isdigit():\n        raise ValueError(s)\n"
        "    return int(s)\ndef leave(code):\n    sys.exit(code)\n",
        "def rejects(x):\n    try:\n        parse(x)\n    except Exception:\n        return True\n"
        "    return False\ndef exit_code(c):\n    try:\n        leave(c)\n"
        "    except SystemExit as exc:\n        return str(exc)\n"
        "def message(x):\n    try:\n        parse(x)\n    except ValueError as exc:\n        return str(exc)\n"
        "assert rejects('x') and not rejects('1')\nassert exit_code(3) == '3'\n"
        "assert message('-1') == '-1'\n"),
    "generators_and_iterators": (
        "def gen(n):\n    for i in range(n):\n        yield i * i\n"
        "def pairs(xs):\n    return zip(xs, xs[1:])\n"
        "def evens(xs):\n    return filter(lambda x: x % 2 == 0, xs)\n",
        "assert list(gen(3)) == [0, 1, 4]\nassert next(gen(5)) == 0\n"
        "assert list(pairs([1, 2, 3])) == [(1, 2), (2, 3)]\n"
        "assert sum(evens(x for x in [1, 2, 4])) == 6\nassert gen(2) != [0, 1]\n"),
    "many_stdlib_imports": (
        "import unittest, doctest, timeit, argparse, csv, io, shlex, glob, fnmatch, pickle\n"
        "import base64, binascii, zlib, gzip, bz2, lzma, html, xml.etree.ElementTree\n"
        "import urllib.parse, email, uuid, ast, dis, tokenize, inspect, contextlib, abc\n"
        "import weakref, queue, sched, threading, concurrent.futures, socket, select\n"
        "import selectors, signal, locale, gettext, pprint, reprlib, graphlib\n"
        "def encoded(b):\n    return base64.b64encode(b)\n"
        "def order(graph):\n    return list(graphlib.TopologicalSorter(graph).static_order())\n"
        "class T(unittest.TestCase):\n    def test(self):\n        self.assertEqual(encoded(b'a'), b'YQ==')\n",
        "assert encoded(b'a') == b'YQ=='\nassert order({'b': {'a'}}) == ['a', 'b']\n"),
    "builtin_modules_and_reloads": (
        "import importlib, os, posix, pwd, _string, faulthandler, string\n"
        "importlib.reload(os)\nimportlib.reload(posix)\n"
        "def fmt(n):\n    return string.Formatter().format('{0}!', n)\n",
        "assert fmt(1) == '1!'\n"),
    "zoneinfo_warnings_logging": (
        "import warnings, logging, datetime\nfrom zoneinfo import ZoneInfo\nwarnings.warn('w')\n"
        "logging.warning('l')\ndef offset():\n"
        "    t = datetime.datetime(2020, 1, 1, tzinfo=ZoneInfo('Europe/Paris'))\n"
        "    return t.utcoffset().total_seconds()\n",
        "assert offset() == 3600.0\n"),
}


# Programs that touch what the kernel layers and the module registration changed: the
# program's own module in sys.modules (string annotations, pickle, copy, typing), dict
# views crossing, files moved between the work directory's folders (Landlock's REFER),
# extension modules loaded after seccomp and Landlock are in, big values and outputs.
CORRECT_MORE: dict[str, tuple[str, str]] = {
    "dataclass_future_annotations": (
        "from __future__ import annotations\nfrom dataclasses import dataclass, field\n"
        "@dataclass(order=True)\nclass Item:\n    name: str\n    tags: list[str] = field(default_factory=list)\n"
        "def make(n):\n    return sorted(Item(str(i)) for i in range(n))[0].name\n",
        "assert make(3) == '0'\n"),
    "dataclass_classvar_future_annotations": (
        "from __future__ import annotations\nimport dataclasses, typing\n"
        "@dataclasses.dataclass(frozen=True)\nclass P:\n    x: int\n    y: int = 0\n"
        "    registry: typing.ClassVar[dict] = {}\n"
        "def fields():\n    return [f.name for f in dataclasses.fields(P)]\n",
        "assert fields() == ['x', 'y']\n"),
    "pickle_own_classes": (
        "import pickle\nclass Node:\n    def __init__(self, v, nxt=None):\n        self.v, self.nxt = v, nxt\n"
        "def roundtrip(xs):\n    head = None\n    for x in reversed(xs):\n        head = Node(x, head)\n"
        "    head = pickle.loads(pickle.dumps(head))\n    out = []\n    while head:\n"
        "        out.append(head.v)\n        head = head.nxt\n    return out\n",
        "assert roundtrip([1, 2, 3]) == [1, 2, 3]\n"),
    "deepcopy_own_dataclass": (
        "import copy\nfrom dataclasses import dataclass\n@dataclass\nclass Box:\n    items: list\n"
        "def independent():\n    a = Box([1])\n    b = copy.deepcopy(a)\n    b.items.append(2)\n"
        "    return a.items, b.items\n",
        "assert independent() == ([1], [1, 2])\n"),
    "typing_get_type_hints_and_namedtuple": (
        "from __future__ import annotations\nimport typing\n"
        "class Pair(typing.NamedTuple):\n    a: int\n    b: str\n"
        "def hints():\n    return sorted(typing.get_type_hints(Pair))\n"
        "def swap(p):\n    return Pair(*p)._replace(a=0)\n",
        "assert hints() == ['a', 'b']\nassert swap((1, 'x')) == (0, 'x')\n"),
    "enum_and_singledispatch": (
        "from __future__ import annotations\nimport enum, functools, pickle\n"
        "class Color(enum.Enum):\n    RED = 1\n    BLUE = 2\n"
        "@functools.singledispatch\ndef describe(x) -> str:\n    return 'thing'\n"
        "@describe.register\ndef _(x: int) -> str:\n    return 'int'\n"
        "def check():\n    return [describe(1), describe('a'), pickle.loads(pickle.dumps(Color.RED)).name]\n",
        "assert check() == ['int', 'thing', 'RED']\n"),
    "dict_views_returned": (
        "def keys(d):\n    return d.keys()\ndef values(d):\n    return d.values()\n"
        "def items(d):\n    return d.items()\n",
        "assert keys({'a': 1, 'b': 2}) == {'a', 'b'}\nassert list(values({'a': 1})) == [1]\n"
        "assert sorted(items({'b': 2, 'a': 1})) == [('a', 1), ('b', 2)]\n"
        "assert len(keys({1: 2})) == 1 and 1 in keys({1: 2})\nassert items({1: 2}) == {(1, 2)}\n"),
    "sets_tuples_ranges_returned": (
        "def evens(n):\n    return frozenset(range(0, n, 2))\ndef span(n):\n    return range(n)\n"
        "def pair(a, b):\n    return (b, a)\ndef uniq(xs):\n    return set(xs)\n",
        "assert evens(5) == {0, 2, 4}\nassert list(span(3)) == [0, 1, 2]\nassert pair(1, 2) == (2, 1)\n"
        "assert uniq([1, 1, 2]) == {1, 2}\n"),
    "generators_and_yield_from": (
        "def chain(*its):\n    for it in its:\n        yield from it\n"
        "def squares(n):\n    return (i * i for i in range(n))\n"
        "def fib():\n    a, b = 0, 1\n    while True:\n        yield a\n        a, b = b, a + b\n"
        "def first(n):\n    import itertools\n    return list(itertools.islice(fib(), n))\n",
        "assert list(chain([1], (2, 3))) == [1, 2, 3]\nassert sum(squares(4)) == 14\n"
        "assert first(7) == [0, 1, 1, 2, 3, 5, 8]\n"),
    "classes_inheritance_and_properties": (
        "import abc\nclass Shape(abc.ABC):\n    @abc.abstractmethod\n    def area(self): ...\n"
        "    @property\n    def double(self):\n        return 2 * self.area()\n"
        "class Sq(Shape):\n    def __init__(self, s):\n        self.s = s\n    def area(self):\n"
        "        return self.s ** 2\n    def __repr__(self):\n        return f'Sq({self.s})'\n"
        "def total(sides):\n    return sum(Sq(s).double for s in sides), repr(Sq(sides[0]))\n",
        "assert total([1, 2]) == (10, 'Sq(1)')\n"),
    "deep_recursion": (
        "import sys\nsys.setrecursionlimit(20000)\n"
        "def ackermann(m, n):\n    if m == 0:\n        return n + 1\n    if n == 0:\n"
        "        return ackermann(m - 1, 1)\n    return ackermann(m - 1, ackermann(m, n - 1))\n"
        "def count(n):\n    return 0 if n == 0 else 1 + count(n - 1)\n",
        "assert ackermann(2, 3) == 9\nassert count(8000) == 8000\n"),
    "large_values_both_ways": (
        "def big(n):\n    return 'x' * n\ndef echo(xs):\n    return [x + 1 for x in xs]\n"
        "def huge_int():\n    return 7 ** 20000\n",
        "assert len(big(2 * 10 ** 6)) == 2 * 10 ** 6\nassert echo(list(range(10 ** 5)))[-1] == 10 ** 5\n"
        "assert huge_int() % 1000 == pow(7, 20000, 1000)\n"),
    "large_printed_output": (
        "def shout(n):\n    for i in range(n):\n        print('row', i, 'x' * 100)\n    return n\n",
        "assert shout(20000) == 20000\n"),
    "files_moved_between_folders": (
        "import os, shutil, tempfile\ndef move():\n    os.makedirs('a/b', exist_ok=True)\n"
        "    os.makedirs('c', exist_ok=True)\n    open('a/b/f.txt', 'w').write('hi')\n"
        "    os.rename('a/b/f.txt', 'c/g.txt')\n    shutil.move('c/g.txt', 'a/h.txt')\n"
        "    with tempfile.TemporaryDirectory() as d:\n        shutil.copytree('a', os.path.join(d, 'copy'))\n"
        "        found = sorted(os.listdir(os.path.join(d, 'copy')))\n"
        "    os.truncate('a/h.txt', 1)\n    return found, open('a/h.txt').read()\n",
        "assert move() == (['b', 'h.txt'], 'h')\n"),
    "compression_extensions": (
        "import zlib, bz2, lzma, gzip, io\n"
        "def sizes(s):\n    b = s.encode()\n    out = []\n    for mod in (zlib, bz2, lzma):\n"
        "        out.append(mod.decompress(mod.compress(b)) == b)\n"
        "    buf = io.BytesIO()\n    with gzip.GzipFile(fileobj=buf, mode='wb') as g:\n        g.write(b)\n"
        "    return out + [gzip.decompress(buf.getvalue()) == b]\n",
        "assert sizes('abc' * 100) == [True, True, True, True]\n"),
    "hashing_struct_array": (
        "import hashlib, struct, array, binascii\n"
        "def digest(s):\n    return hashlib.sha256(s.encode()).hexdigest()[:8]\n"
        "def pack(a, b):\n    return struct.unpack('<ih', struct.pack('<ih', a, b))\n"
        "def arr(n):\n    return array.array('i', range(n)).tolist()\n"
        "def crc(b):\n    return binascii.crc32(b)\n",
        "assert digest('a') == 'ca978112'\nassert pack(-1, 2) == (-1, 2)\nassert arr(3) == [0, 1, 2]\n"
        "assert crc(b'abc') == 891568578\n"),
    "randomness_and_uuid": (
        "import random, secrets, uuid, os\n"
        "def seeded():\n    r = random.Random(42)\n    return [r.randint(0, 9) for _ in range(3)]\n"
        "def fresh():\n    return len(secrets.token_hex(8)), uuid.uuid4().version, len(os.urandom(4))\n",
        "assert seeded() == [1, 0, 4]\nassert fresh() == (16, 4, 4)\n"),
    "time_and_locale": (
        "import time, datetime, locale, calendar\n"
        "def stamp():\n    t = time.localtime(0)\n    return t.tm_year in (1969, 1970), time.monotonic() > 0\n"
        "def days(y, m):\n    return calendar.monthrange(y, m)[1]\n"
        "def iso(s):\n    return datetime.date.fromisoformat(s).isoweekday()\n"
        "def enc():\n    return locale.getpreferredencoding(False)\n",
        "assert stamp() == (True, True)\nassert days(2024, 2) == 29\nassert iso('2024-01-01') == 1\n"
        "assert enc() == 'UTF-8'\n"),
    "platform_and_os_queries": (
        "import os, platform, sys, resource\n"
        "def info():\n    return (os.cpu_count() >= 1, bool(platform.machine()), sys.maxsize > 2 ** 31,\n"
        "            resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 0, os.getpid() > 0)\n",
        "assert info() == (True, True, True, True, True)\n"),
    "exceptions_and_context_managers": (
        "import contextlib\nclass Oops(ValueError):\n    pass\n"
        "@contextlib.contextmanager\ndef tracked(log):\n    log.append('in')\n    try:\n        yield\n"
        "    finally:\n        log.append('out')\n"
        "def run(x):\n    log = []\n    try:\n        with tracked(log):\n            if x < 0:\n"
        "                raise Oops('neg')\n    except ValueError as e:\n        log.append(str(e))\n"
        "    return log\ndef strict(x):\n    if x < 0:\n        raise ValueError('bad')\n    return x\n",
        "assert run(-1) == ['in', 'out', 'neg']\nassert run(1) == ['in', 'out']\n"
        "try:\n    strict(-1)\n    ok = False\nexcept ValueError:\n    ok = True\nassert ok\n"),
    "json_csv_io_in_memory": (
        "import json, csv, io\ndef table(rows):\n    buf = io.StringIO()\n    w = csv.writer(buf)\n"
        "    w.writerows(rows)\n    return list(csv.reader(io.StringIO(buf.getvalue())))\n"
        "def nested(n):\n    d = {'k': []}\n    cur = d['k']\n    for i in range(n):\n"
        "        cur.append({'i': i})\n    return json.loads(json.dumps(d))\n",
        "assert table([[1, 'a'], [2, 'b']]) == [['1', 'a'], ['2', 'b']]\n"
        "assert len(nested(100)['k']) == 100\n"),
    "memoized_class_methods_and_slots": (
        "from functools import cached_property, total_ordering\n@total_ordering\nclass V:\n"
        "    __slots__ = ('x', '__dict__')\n    def __init__(self, x):\n        self.x = x\n"
        "    def __eq__(self, o):\n        return self.x == o.x\n    def __lt__(self, o):\n"
        "        return self.x < o.x\n    @cached_property\n    def sq(self):\n        return self.x * self.x\n"
        "def biggest(xs):\n    return max(V(x) for x in xs).sq\n",
        "assert biggest([3, 1, 2]) == 9\n"),
}


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no_namespaces"])
def test_correct_programs_pass(namespaces: bool):
    programs = {**CORRECT, **CORRECT_MORE}
    names = list(programs)
    results = run_many([programs[n] for n in names], timeout_s=10.0, workers=2,
                       namespaces=namespaces)
    assert len(CORRECT_MORE) >= 20
    for name, result in zip(names, results, strict=True):
        assert isinstance(result, CodeResult)
        assert (result.passed, result.error) == (True, None), (name, result)
        assert result.passed_count == result.total, name
