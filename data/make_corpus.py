"""Rebuild data/corpus.txt deterministically from text every Python install carries.

The shipped corpus is the English documentation of a fixed list of Python standard
library modules (module, class and function docstrings, in a fixed order), plus the
Zen of Python. Python's documentation is under the PSF license. Nothing is downloaded.

    python data/make_corpus.py            # writes data/corpus.txt
    python data/make_corpus.py --check    # exit 1 if the file differs

The committed corpus.txt was written with CPython 3.11; other versions give slightly
different text, which is why the file itself ships and training never runs this script.
"""

import argparse
import codecs
import importlib
import inspect
import sys
import warnings
from pathlib import Path

MODULES = [
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "bz2", "calendar",
    "cmath", "collections", "colorsys", "concurrent.futures", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "email",
    "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools", "gc", "getopt",
    "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client",
    "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "keyword", "linecache",
    "locale", "logging", "lzma", "mailbox", "math", "mimetypes", "multiprocessing",
    "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pickletools",
    "platform", "plistlib", "poplib", "pprint", "queue", "quopri", "random", "re",
    "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "signal", "smtplib",
    "socket", "socketserver", "sqlite3", "statistics", "string", "struct", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "token", "tokenize",
    "trace", "traceback", "types", "typing", "unittest", "urllib.parse", "uuid",
    "warnings", "wave", "weakref", "xml.dom.minidom", "zipfile", "zlib",
]
TARGET_BYTES = 400_000


def _clean(doc: str) -> str:
    doc = inspect.cleandoc(doc)
    # keep plain printable ASCII and newlines only
    return "".join(c for c in doc if c == "\n" or 32 <= ord(c) < 127)


def build() -> str:
    warnings.simplefilter("ignore", DeprecationWarning)
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen
        import this as _this
    parts = ["The Zen of Python, by Tim Peters\n\n" + codecs.decode(_this.s, "rot13").split(
        "\n\n", 1)[-1]]
    seen = set()
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        items = [(name, mod)]
        for attr in sorted(vars(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                items.append((f"{name}.{attr}", obj))
                if inspect.isclass(obj):
                    for m in sorted(vars(obj)):
                        if not m.startswith("_") and inspect.isfunction(vars(obj)[m]):
                            items.append((f"{name}.{attr}.{m}", vars(obj)[m]))
        for qual, obj in items:
            doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
            if not doc or len(doc) < 80:
                continue
            text = _clean(doc)
            if text in seen:
                continue
            seen.add(text)
            parts.append(f"{qual}\n\n{text}")
    out, size = [], 0
    for p in parts:
        if size >= TARGET_BYTES:
            break
        out.append(p)
        size += len(p) + 2
    return "\n\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    path = Path(__file__).with_name("corpus.txt")
    text = build()
    if args.check:
        same = path.exists() and path.read_text() == text
        print("corpus.txt is up to date" if same else "corpus.txt differs")
        sys.exit(0 if same else 1)
    path.write_text(text)
    print(f"wrote {path} ({len(text.encode())} bytes)")


if __name__ == "__main__":
    main()
