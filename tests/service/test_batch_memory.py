"""No batch grows past the memory the host has left (issue 32, point 6): on a CPU one Score batch of
8,192 tokens of embedded:tiny raised the peak RSS from 0.7 to 5.0 GB. buckets.activation_bytes with
dense_attention (the ATen path's T x T scores) bounds what a batch takes, the Scheduler grows no batch
past max_batch_bytes, and the server derives that from the cgroup / MemAvailable on a CPU."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from service.artifact.buckets import activation_bytes
from service.runtime.requests import ScoreRequest
from service.sched.admission import AdmissionConfig
from service.sched.batcher import BatcherConfig, Scheduler
from service.sched.memory import available_memory_bytes
from service.serving.server import batch_memory_bytes

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import torch
from service.artifact.artifact import load_artifact
from service.runtime.batch import pack_beam, pack_score, pick_bucket
from service.runtime.cpp_runtime import CppRuntime
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, ScoreRequest
art = load_artifact(sys.argv[1])
rt = PythonRuntime(art) if sys.argv[2] == "python" else CppRuntime(art, device="cpu")
if sys.argv[3] == "score":  # 8 requests of 12 samples x 20 tokens: about 2,000 tokens
    reqs = [ScoreRequest(tuple((i % 97 + 1,) * 20 for i in range(12)), (1,)) for _ in range(8)]
    b = pick_bucket(art.buckets, reqs)
    run = lambda: rt.run_score(pack_score(reqs, b, 1))
else:  # 3 requests of prompt 300 and beam 100, 3 new tokens
    reqs = [BeamRequest(tuple(range(1, 301)), 100, 3) for _ in range(3)]
    b = pick_bucket(art.buckets, reqs)
    run = lambda: rt.run_beam(pack_beam(reqs, b, art.catalogs))
def status(key):  # kB -> bytes
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
torch.set_num_threads(1)
with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from the resident set
    f.write("5")
before = status("VmRSS")
run()
print(json.dumps({"bucket": b.key, "grown": status("VmHWM") - before}))
"""


@pytest.fixture(scope="module")
def art(embedded_tiny):
    return embedded_tiny


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["python", "cpp"])
@pytest.mark.parametrize("kind", ["score", "beam"])
def test_the_estimate_bounds_a_cpu_batch(art, runtime: str, kind: str) -> None:
    """The peak RSS one CPU batch adds lies under the ATen estimate, and not far under (a bound of
    no use would pass the first check alone)."""
    path, artifact = art
    proc = subprocess.run([sys.executable, "-c", PROBE, str(path), runtime, kind], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    bucket = next(b for bs in artifact.buckets.kinds.values() for b in bs if b.key == got["bucket"])
    estimate = activation_bytes(bucket, artifact.config, 4, dense_attention=True)
    assert got["grown"] <= estimate, (got, estimate)
    assert got["grown"] >= estimate / 8, (got, estimate)
    assert activation_bytes(bucket, artifact.config, 4) < estimate / 2, "the dense terms dominate here"


class CountingRuntime:
    """Records each Score batch's bucket; answers zeros at once."""

    name = "counting"
    kernels = "aten"
    dtype = torch.float32

    def __init__(self) -> None:
        self.buckets: list[Any] = []

    def run_score(self, batch: Any) -> torch.Tensor:
        self.buckets.append(batch.bucket)
        return torch.zeros(batch.bucket.max_samples, batch.num_labels)


def _four_at_once(artifact: Any, max_batch_bytes: float) -> CountingRuntime:
    rt, rng = CountingRuntime(), random.Random(3)
    ids = lambda n: tuple(rng.randrange(500) for _ in range(n))  # noqa: E731

    async def main() -> None:
        s = Scheduler(artifact, rt, AdmissionConfig(), BatcherConfig(max_inflight=1, max_wait_s=0.05),
                      max_batch_bytes=max_batch_bytes)
        await s.start()
        reqs = [ScoreRequest(tuple(ids(40) for _ in range(10)), (1, 2)) for _ in range(4)]
        await asyncio.gather(*(s.submit(r) for r in reqs))
        await s.close()

    asyncio.run(main())
    return rt


def test_no_batch_grows_past_max_batch_bytes(art) -> None:
    _, artifact = art
    size = lambda b: activation_bytes(b, artifact.config, 4, dense_attention=True)  # noqa: E731
    together = _four_at_once(artifact, float("inf"))
    assert len(together.buckets) == 1, [b.key for b in together.buckets]  # the four share one batch
    alone = min(size(b) for b in artifact.buckets.of_kind("score") if b.max_tokens >= 400 and b.max_samples >= 10)
    bound = (alone + size(together.buckets[0])) / 2  # one alone fits, all four together do not
    bounded = _four_at_once(artifact, bound)
    assert len(bounded.buckets) > 1 and all(size(b) <= bound for b in bounded.buckets), \
        [(b.key, size(b)) for b in bounded.buckets]


def test_available_memory_reads_the_cgroup_and_meminfo(tmp_path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 100 kB\nMemAvailable:  2000 kB\n")
    assert available_memory_bytes(tmp_path) == 2000 * 1024
    cg = tmp_path / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text("1500000\n")
    (cg / "memory.current").write_text("1000000\n")
    assert available_memory_bytes(tmp_path) == 500000  # the container's limit is the tighter
    (cg / "memory.max").write_text("max\n")
    assert available_memory_bytes(tmp_path) == 2000 * 1024
    assert available_memory_bytes(tmp_path / "nothing") == float("inf")
    assert 0 < available_memory_bytes() < float("inf")  # this machine's


def test_the_server_bounds_cpu_batches_only() -> None:
    class On:
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

    assert batch_memory_bytes(On("cuda"), None) == float("inf")
    cpu = batch_memory_bytes(On("cpu"), BatcherConfig(max_inflight=2))
    assert 0 < cpu <= available_memory_bytes() / 4 * 1.01
