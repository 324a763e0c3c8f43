"""`slmrank serve --model embedded:tiny` in a subprocess on free ports, for the end-to-end tests:
the process and a queue of its stdout lines (where it announces its addresses), and its port."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_serve(cache: Path, log: Path, *args: str) -> tuple[subprocess.Popen, queue.Queue[str]]:
    env = dict(os.environ, SLMRANK_CACHE=str(cache), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--model", "embedded:tiny", "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=log.open("w"), text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    return proc, lines


def wait_port(proc: subprocess.Popen, lines: queue.Queue[str], log: Path) -> int:
    """The Ranker port serve announces ("listening on 127.0.0.1:PORT"), within 120 s."""
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, f"serve exited: {log.read_text()}"
            continue
        if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
            return int(m.group(1))
    raise AssertionError("serve printed no address")
