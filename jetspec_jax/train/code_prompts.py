"""Coding prompts made from the Python standard library's own functions and classes.

For each public function, class and method of the modules below that has a docstring: a
"write this function" prompt from its signature and the first paragraph of its docstring (the
wording a seeded choice), explain / test prompts, and for short ones edit / explain prompts
that show its source; and, for completion, each function's signature and docstring as a stub.
Deterministic for a seed on one Python version (the order is sorted, not import order).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import random
import warnings
from collections.abc import Iterator

MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmath", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "functools",
    "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html",
    "html.parser", "http.cookies", "inspect", "ipaddress", "itertools", "json", "keyword",
    "linecache", "locale", "logging", "mimetypes", "numbers", "operator", "optparse", "os",
    "os.path", "pathlib", "pickle", "platform", "plistlib", "pprint", "queue", "quopri",
    "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil", "socketserver", "sqlite3",
    "statistics", "string", "struct", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "tomllib", "traceback", "types", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "wsgiref.util", "xml.dom.minidom",
    "xml.etree.ElementTree", "zipfile", "zlib", "asyncio", "bdb", "cmd", "code", "codeop",
    "compileall", "concurrent.futures", "dis", "doctest", "email.message", "ftplib",
    "http.client", "http.server", "imaplib", "importlib.metadata", "mailbox", "netrc",
    "pdb", "pkgutil", "poplib", "pstats", "py_compile", "pyclbr", "pydoc", "runpy", "selectors",
    "shelve", "smtplib", "socket", "ssl", "subprocess", "symtable", "sysconfig", "tabnanny",
    "trace", "tracemalloc", "unittest.mock", "urllib.robotparser", "wave", "xml.sax.saxutils",
    "zipapp", "zoneinfo")
# Packages whose public submodules are walked too (after MODULES, in sorted order).
PACKAGES = ("asyncio", "collections", "concurrent", "dbm", "email", "http", "importlib", "json",
            "logging", "multiprocessing", "sqlite3", "unittest", "urllib", "wsgiref", "xml",
            "xmlrpc")
MAX_SOURCE_LINES = 25  # longer sources would not fit a prompt
MAX_DOC_LINES = 12  # of a stub's docstring
MIN_DOC_CHARS = 20  # shorter docstrings say too little to prompt with

WRITE = ("Write a Python function `{sig}` that {doc}",
         "Implement `{sig}` in Python. It should do the following: {doc}",
         "In Python, write `{sig}`. Specification: {doc} Include a short docstring.")
WRITE_CLASS = ("Write a Python class `{name}` with constructor `{sig}`. {doc}",
               "Implement a small Python class `{name}` ({sig}): {doc}")
ABOUT = ("Explain what `{qual}` from Python's standard library does and give a short example "
         "of using it.",
         "Write a few pytest unit tests for `{qual}` from the Python standard library.",
         "When would you use `{qual}` in Python? Show an example and one common mistake.")
WITH_SOURCE = ("Explain what this Python function does, line by line:\n\n```python\n{src}```",
               "Add type hints and a clear docstring to this Python function:\n\n```python\n{src}```",
               "Refactor this Python function to make it easier to read, and explain the "
               "changes:\n\n```python\n{src}```",
               "Rewrite this Python function in JavaScript:\n\n```python\n{src}```",
               "Are there edge cases this Python function handles badly? Explain:\n\n"
               "```python\n{src}```")
COMPLETE = ("Complete this Python function.\n```python\n{stub}```",
            "Finish the implementation of this Python function:\n\n```python\n{stub}```",
            "```python\n{stub}```\nWrite the body of this function.",
            "Implement the function below.\n\n```python\n{stub}```")


def _first_paragraph(doc: str) -> str:
    """The docstring's opening paragraph as a clause: "Return x." -> "return x." """
    para = " ".join(doc.strip().split("\n\n")[0].split())
    return para[:1].lower() + para[1:] if para[1:2].islower() else para


def _docstring(obj) -> str | None:
    """The object's docstring, if it says enough to make a prompt of."""
    doc = inspect.getdoc(obj)
    return doc if doc and len(doc) >= MIN_DOC_CHARS else None


def _is_python(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def _signature(name: str, obj) -> str | None:
    """`name(params)`, if it is Python: a default's repr such as `<object object at 0x...>`
    is not, and would differ from process to process."""
    try:
        sig = f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):  # builtins without a text signature
        return None
    return sig if _is_python(f"def {sig}: pass") else None


def module_names() -> list[str]:
    """MODULES, then the public submodules of PACKAGES not among them."""
    walked = set()
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        walked |= {m.name for m in pkgutil.walk_packages(path, f"{package}.")
                   if not any(part.startswith("_") for part in m.name.split("."))}
    return [*MODULES, *sorted(walked - set(MODULES))]


def _members(modname: str) -> Iterator[tuple[str, object]]:
    """(qualified name, object) of the module's own public functions, classes and methods."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(modname)
    except ImportError:
        return
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield f"{modname}.{name}", obj
        elif inspect.isclass(obj):
            yield f"{modname}.{name}", obj
            for mname, m in sorted(vars(obj).items()):
                if not mname.startswith("_") and inspect.isfunction(m):
                    yield f"{modname}.{name}.{mname}", m


def _source(obj) -> str | None:
    try:
        lines = inspect.getsource(obj).splitlines(keepends=True)
    except (OSError, TypeError):
        return None
    if len(lines) > MAX_SOURCE_LINES:
        return None
    indent = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
    return "".join(x[indent:] if x.strip() else "\n" for x in lines)


def code_prompts(seed: int = 0) -> Iterator[str]:
    """Prompts for every documented public function / class / method of the modules."""
    r = random.Random(f"code-{seed}")
    for modname in module_names():
        for qual, obj in _members(modname):
            doc = _docstring(obj)
            if not doc:
                continue
            name = qual.rsplit(".", 1)[1]
            sig = _signature(name, obj)
            text = _first_paragraph(doc)
            if sig and inspect.isclass(obj):
                yield r.choice(WRITE_CLASS).format(name=name, sig=sig, doc=text)
            elif sig:
                yield r.choice(WRITE).format(sig=sig, doc=text)
            yield from (t.format(qual=qual) for t in ABOUT)
            src = _source(obj) if inspect.isfunction(obj) else None
            if src:
                yield from (t.format(src=src) for t in WITH_SOURCE)


def _stub(name: str, obj) -> str | None:
    """`def name(...):` and its docstring (at most MAX_DOC_LINES lines), with no body."""
    sig, doc = _signature(name, obj), _docstring(obj)
    if not sig or not doc:
        return None
    lines = doc.replace('"""', "'''").splitlines()[:MAX_DOC_LINES]
    body = "\n".join(f"    {x.rstrip()}" if x.strip() else "" for x in lines)
    stub = f'def {sig}:\n    """{body.lstrip()}\n    """\n'
    return stub if _is_python(stub) else None  # not, where a docstring ends in a backslash


def stub_prompts(seed: int = 0) -> Iterator[str]:
    """Code completion: the signature and docstring of each documented public function and
    method of the modules, to be completed (the form of a function-completion benchmark)."""
    r = random.Random(f"stubs-{seed}")
    for modname in module_names():
        for qual, obj in _members(modname):
            stub = _stub(qual.rsplit(".", 1)[1], obj) if inspect.isfunction(obj) else None
            if stub:
                yield r.choice(COMPLETE).format(stub=stub)
