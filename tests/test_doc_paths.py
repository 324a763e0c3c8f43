"""No comment or doc names a path that does not exist.

Every tracked text file (and every new one git does not ignore) is read for path-like tokens that
start with a top-level name of the project (`service/`, `cpp_dag/`, `kernels/`, `proto/`, `tests/`,
`ops/`, `docs/`, `LICENSES/`, `.ci/`): Markdown, C++ and headers, TOML, YAML, the .proto, the
Dockerfile, CMakeLists.txt and the shell scripts under ops/ as a whole; Python and its stubs in
their comments and docstrings (other strings are data: a test may make up a path on purpose, and
code that opens a missing file fails when it runs). Each token must name a file or directory of
the checkout: a glob (`cpp_dag/node_*.cpp`) at least one, a brace form (`executor.{h,cpp}`) each
alternative. A token ends at the first character no path has (`:12`, `::test_x`, a space) and
loses trailing punctuation. A Markdown link's relative target (`[x](history/benchmarks.md)`) must
exist from the linking file's directory.

Not checked: docs/history/ (a dated record of what was true then) and paths git ignores (what a
build or a run generates: `service/_gen/`, `cpp_dag/_core*.so`).
"""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("service", "cpp_dag", "kernels", "proto", "tests", "ops", "docs", "LICENSES", ".ci")
EXEMPT = ("docs/history/",)
WHOLE_TEXT_SUFFIXES = {".md", ".cpp", ".h", ".toml", ".yaml", ".yml", ".proto"}
PYTHON_SUFFIXES = {".py", ".pyi"}

# a top-level name not inside a longer path or word (`$OUT/ops/x`, `./service`, `a.service/` are not
# project paths), then path characters and `{a,b}` groups
_TOKEN = re.compile(r"(?<![\w./\-~$])(?:%s)/(?:[\w.\-*?/]|\{[\w.,\-*/]*\})*" % "|".join(map(re.escape, TOP_LEVEL)))


def path_tokens(text: str) -> Iterator[str]:
    for m in _TOKEN.finditer(text):
        token = m.group(0).rstrip(".,;:-")
        if ".*" in token or text[m.end():m.end() + 1] == "\\":
            continue  # a regular expression (`cpp_dag/.*\.cpp`), not a path
        yield token


_LINK = re.compile(r"\]\(([^()\s#]+)(?:#[^()\s]*)?\)")


def link_targets(text: str) -> Iterator[str]:
    """The relative targets of Markdown links (not URLs, not a page's own anchors)."""
    for m in _LINK.finditer(text):
        if not re.match(r"[a-z][a-z0-9+.-]*:", m.group(1)):
            yield m.group(1)


def expand_braces(token: str) -> list[str]:
    """`a.{h,cpp}` -> [`a.h`, `a.cpp`]; a group without a comma is a placeholder (an f-string's
    `{PROTO}`) and matches any one name."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    alternatives = m.group(1).split(",") if "," in m.group(1) else ["*"]
    return [t for a in alternatives for t in expand_braces(token[:m.start()] + a + token[m.end():])]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    wild = {"**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(wild.get(p, re.escape(p)) for p in parts))


def names_something(token: str, known: set[str]) -> bool:
    path = token.rstrip("/")
    if "*" in path or "?" in path:
        rx = _glob_regex(path)
        return any(rx.fullmatch(k) for k in known)
    return path in known


def python_prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and every docstring line of a Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                for n in range(first.lineno, (first.end_lineno or first.lineno) + 1):
                    yield n, lines[n - 1]


def _is_scanned(path: str) -> bool:
    if path.startswith(EXEMPT):
        return False
    p = Path(path)
    if p.suffix in WHOLE_TEXT_SUFFIXES | PYTHON_SUFFIXES or p.name in ("Dockerfile", "CMakeLists.txt"):
        return True
    # the shell scripts under ops/ (ops/setup, ops/device/capacity, ...)
    return path.startswith("ops/") and p.suffix in ("", ".sh") and (ROOT / path).read_bytes()[:2] == b"#!"


def prose_of(path: str) -> Iterator[tuple[int, str]]:
    text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
    if Path(path).suffix in PYTHON_SUFFIXES:
        yield from python_prose(text)
    else:
        yield from enumerate(text.splitlines(), 1)


def _git(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, check=False).stdout


def checkout_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    return sorted({f for f in listed if f and (ROOT / f).is_file()})


def known_paths(files: list[str]) -> set[str]:
    known = set(files)
    for f in files:
        known.update(str(parent) for parent in Path(f).parents if str(parent) != ".")
    return known


def ignored_by_git(paths: set[str]) -> set[str]:
    """The paths .gitignore covers, as a file or as a directory (`/service/_proto/` matches only the
    latter, and a path that does not exist is neither until asked both ways)."""
    if not paths:
        return set()
    asked = sorted(paths | {p + "/" for p in paths})
    answered = _git("check-ignore", "--no-index", "--stdin", stdin="\n".join(asked) + "\n").split("\n")
    return {a.rstrip("/") for a in answered if a}


def missing_paths() -> list[tuple[str, int, str]]:
    files = checkout_files()
    known = known_paths(files)
    misses = [(f, n, token) for f in files if _is_scanned(f) for n, line in prose_of(f)
              for token in path_tokens(line) if not all(names_something(t, known) for t in expand_braces(token))]
    generated = ignored_by_git({t.rstrip("/") for _, _, token in misses for t in expand_braces(token)})
    misses = [(f, n, token) for f, n, token in misses
              if not all(t.rstrip("/") in generated for t in expand_braces(token))]
    links = [(f, n, f"]({target})") for f in files if f.endswith(".md") and _is_scanned(f) for n, line in prose_of(f)
             for target in link_targets(line) if os.path.normpath(Path(f).parent / target) not in known]
    return sorted(misses + links)


def test_every_path_a_comment_or_doc_names_exists():
    misses = missing_paths()
    assert not misses, (f"{len(misses)} paths named in comments and docs do not exist (fix the path; "
                        "docs/history/ is exempt):\n" + "\n".join(f"{f}:{n}: {t}" for f, n, t in misses))


@pytest.mark.parametrize("text, expected", [
    ("see `cpp_dag/node_*.cpp`.", ["cpp_dag/node_*.cpp"]),
    ("moved to service/sched/{admission,batcher}.py, today", ["service/sched/{admission,batcher}.py"]),
    ("service/runtime/batch.py:152 and tests/service/test_x.py::test_y", ["service/runtime/batch.py",
                                                                          "tests/service/test_x.py"]),
    ("[docs/performance.md](docs/performance.md); `.ci/run`", ["docs/performance.md", "docs/performance.md", ".ci/run"]),
    ("https://github.com/a/tests/x $OUT/ops/x ./service/x my.docs/x", []),
    ("grep -qE '^(cpp_dag/.*\\.(cpp|h)|proto/)'", ["proto/"]),
    ("the stubs of proto/{PROTO}", ["proto/{PROTO}"]),
])
def test_the_parser_finds_paths_in_prose(text, expected):
    assert list(path_tokens(text)) == expected


def test_markdown_links_are_read_relative_to_their_page():
    text = "[p](performance.md), [h](history/benchmarks.md#w1), [u](https://x.org/a.md), [a](#overload)"
    assert list(link_targets(text)) == ["performance.md", "history/benchmarks.md"]


def test_brace_forms_expand_and_globs_match():
    assert expand_braces("cpp_dag/executor.{h,cpp}") == ["cpp_dag/executor.h", "cpp_dag/executor.cpp"]
    assert expand_braces("a/{x,y}/{1,2}") == ["a/x/1", "a/x/2", "a/y/1", "a/y/2"]
    assert expand_braces("proto/{PROTO}") == ["proto/*"]
    known = {"cpp_dag", "cpp_dag/node_masks.cpp", "cpp_dag/dag.h", "tests", "tests/e2e", "tests/e2e/t.py"}
    assert names_something("cpp_dag/node_*.cpp", known) and not names_something("cpp_dag/node_*.h", known)
    assert names_something("tests/e2e/", known) and names_something("tests/**.py", known)
    assert not names_something("cpp_dag/*.cu", known) and not names_something("service/nodes.py", known)


def test_python_is_read_in_its_comments_and_docstrings_only():
    source = ('"""Module: service/a.py."""\n'
              'X = "service/made_up.py"  # see service/b.py\n'
              'def f():\n    """Uses\n    service/c.py."""\n    return "service/d.py"\n')
    found = [t for _, text in python_prose(source) for t in path_tokens(text)]
    assert sorted(found) == ["service/a.py", "service/b.py", "service/c.py"]
