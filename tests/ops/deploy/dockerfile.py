"""ops/deploy/Dockerfile read statically (no Docker daemon): its instructions by stage, and the
environment a runtime stage gives `slmrank serve` (what tests/ops/deploy resolves the settings
from, as the container would)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "ops" / "deploy" / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def stages(text: str | None = None) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for op, args in instructions(DOCKERFILE.read_text() if text is None else text):
        if op == "FROM":
            current = args.split(" AS ")[-1].strip() if " AS " in args else args
            out[current] = []
        elif current is not None:
            out[current].append((op, args))
    return out


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults (the build arguments of every stage)."""
    out: dict[str, str] = {}
    for op, args in instructions(DOCKERFILE.read_text()):
        if op == "FROM":
            break
        if op == "ARG":
            name, _, default = args.partition("=")
            out[name] = default
    return out


def image_env(stage: str) -> dict[str, str]:
    """The variables a stage's ENV instructions set (KEY=VALUE form; $VAR references left as written)."""
    env: dict[str, str] = {}
    for op, args in stages()[stage]:
        if op == "ENV":
            for word in shlex.split(args):
                key, sep, value = word.partition("=")
                assert sep, f"{stage}: ENV {word!r} is not KEY=VALUE"
                env[key] = value
    return env
