"""What a `--model` names: an artifact directory as it is, or an embedded spec / Hugging Face
checkpoint built once into the cache ($SLMRANK_CACHE, default ~/.cache/slmrank)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..model import progress
from ..model.checkpoint import embedded_spec, load_hf_config
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


def check_model(model: str) -> None:
    """What can be seen wrong with `model` at once, before a server binds its port (a server that
    said "listening" and then failed would look healthy to whoever started it): an embedded spec
    it does not know, a path that is neither an artifact nor a checkpoint directory, a checkpoint
    whose config.json cannot be read. The rest (weights, hashes) is seen as it loads."""
    if model.startswith("embedded:"):
        embedded_spec(model)  # ValueError: names the known ones
        return
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"--model {model}: no such directory (an artifact or Hugging Face checkpoint "
                                "directory, or embedded:NAME)")
    if not (path / MANIFEST).exists():
        load_hf_config(path)  # no config.json, or one of an architecture slmrank does not serve


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
