"""What a `--model` names: an artifact directory as it is, or an embedded spec / Hugging Face
checkpoint built once into the cache ($SLMRANK_CACHE, default ~/.cache/slmrank)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..model import progress
from .artifact import MANIFEST, Artifact, ArtifactError, build_artifact, load_artifact


def cache_dir() -> Path:
    return Path(os.environ.get("SLMRANK_CACHE", Path.home() / ".cache" / "slmrank"))


def _checkpoint_fingerprint(ckpt: Path) -> str:
    """Path plus every file's name, size and mtime: a changed checkpoint gets a fresh artifact."""
    parts = [str(ckpt.resolve())]
    if ckpt.is_dir():
        for f in sorted(ckpt.iterdir()):
            if f.is_file():
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def resolve_artifact(model: str, quiet: bool = False) -> Artifact:
    """An artifact directory as it is; an embedded spec or a checkpoint is built once into the cache."""
    path = Path(model)
    if path.is_dir() and (path / MANIFEST).exists():
        return load_artifact(path)
    key = model if model.startswith("embedded:") else _checkpoint_fingerprint(path)
    out = cache_dir() / "artifacts" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (out / MANIFEST).exists():
        try:
            return load_artifact(out)
        except ArtifactError as e:
            progress.note(f"rebuilding cached artifact {out}: {e}")
    if not quiet:
        progress.note(f"building artifact for {model} into {out}")
    build_artifact(model, out, quiet=quiet)
    return load_artifact(out)
