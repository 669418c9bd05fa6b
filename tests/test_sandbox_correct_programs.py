"""Correct programs pass the sandbox, with namespaces on and off: no false negatives.

Ordinary MBPP/HumanEval-style solutions and tests, chosen to touch what the
sandbox restricts (imports, files, recursion, printing, exceptions, values at
the edges of the codec).
"""

from __future__ import annotations

import pytest

from reinforge.rewards.code import CodeResult, run_many

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


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no_namespaces"])
def test_correct_programs_pass(namespaces: bool):
    names = list(CORRECT)
    results = run_many([CORRECT[n] for n in names], timeout_s=10.0, workers=2,
                       namespaces=namespaces)
    assert len(names) >= 10
    for name, result in zip(names, results, strict=True):
        assert isinstance(result, CodeResult)
        assert (result.passed, result.error) == (True, None), (name, result)
        assert result.passed_count == result.total, name
