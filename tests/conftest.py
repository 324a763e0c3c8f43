"""Root fixtures: the GPU marker's skip, and the builder of tiny random Hugging Face checkpoints
that the service and C++-runtime fixtures share (fixed seeds, pytest tmp dirs, no downloads)."""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run through Triton's interpreter on the CPU (read when a kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")


# modules with no GPU test that import a package only `ops/setup` installs (the dev extra), which
# the GPU machine lacks: a `-m gpu` run there leaves them out instead of failing to import them
CPU_ONLY_IMPORTS = {"tests/ops/deploy/test_k8s_manifests.py": "kubernetes_validate",
                    "tests/service/test_tls.py": "cryptography"}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("markexpr", "") != "gpu":
        return None
    path, root = collection_path.resolve(), Path(__file__).resolve().parents[1]
    package = CPU_ONLY_IMPORTS.get(path.relative_to(root).as_posix()) if path.is_relative_to(root) else None
    return True if package and importlib.util.find_spec(package) is None else None


def pytest_configure(config: pytest.Config) -> None:
    # registered here, not in pyproject.toml (a change there rebuilds the carried extension on the device)
    config.addinivalue_line("markers", "xdist_group(name): one pytest-xdist worker runs the group under "
                            "--dist loadgroup (GPU tests of tens of GB)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    """After every GPU test (and a module's last, its module fixtures torn down), the CUDA memory it
    cached goes back to the device: an xdist worker would otherwise keep the largest test's reserve
    while the other workers run theirs. Eight workers after each module ran an 80 GB H100 out of
    memory (a module's 28 GB reserve); six did (2026-12-06, one worker holding 64 GB, 47.7 GB of it
    cached and free, while five tests of other workers failed to allocate)."""
    yield
    if torch.cuda.is_available() and "gpu" in item.keywords:
        gc.collect()
        torch.cuda.empty_cache()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With SLMRANK_TEST_REPORTS=FILE, a line per test's outcome ("passed <nodeid> 3.2 s"; a setup
    error too), each failure's traceback and each test's printed lines are appended to FILE as the
    reports arrive (under xdist in the controlling process only, so once), so a device call that its
    time limit cuts still brings back which tests ran, why one failed and what they printed (pytest's
    own summary comes only at the end)."""
    path = os.environ.get("SLMRANK_TEST_REPORTS")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    printed = report.capstdout if report.when == "teardown" else ""  # a test's printing, all phases
    outcome = report.when == "call" or (report.failed or report.skipped) and report.when == "setup"
    if not (outcome or report.failed or printed):
        return
    with open(path, "a", encoding="utf-8") as f:
        if outcome:
            f.write(f"{report.outcome} {report.nodeid} {report.duration:.1f} s\n")
        if printed or report.failed:
            f.write(f"=== {report.nodeid} {report.when}: {report.outcome}\n")
        if printed:
            f.write(printed.rstrip("\n") + "\n")
        if report.failed:
            f.write(report.longreprtext.rstrip("\n") + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _save_tiny_checkpoint(root: Path, name: str, arch: str, cls_name: str, seed: int, *, vocab: int,
                          max_pos: int, save_kw: dict[str, Any] | None = None, **cfg_extra: Any):
    """A random transformers Qwen2/Qwen3 model (2 layers, hidden 64, GQA 4/2, head_dim 16) with
    random RMSNorm gains (HF initialises them to 1: a mis-wired norm must show), saved with
    save_pretrained under root/name. Returns (model in eval mode, checkpoint dir)."""
    import transformers

    cfg_cls = transformers.Qwen2Config if arch == "qwen2" else transformers.Qwen3Config
    kw: dict[str, Any] = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=max_pos, initializer_range=0.3, rope_theta=10000.0,
                              rms_norm_eps=1e-6)
    kw.update(cfg_extra)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg_cls(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    ckpt = root / name
    model.save_pretrained(ckpt, **(save_kw or {}))
    return model, ckpt


@pytest.fixture(scope="session")
def save_tiny_checkpoint() -> Callable[..., Any]:
    return _save_tiny_checkpoint
