"""`slmrank serve --model embedded:tiny` in a subprocess on free ports, for the end-to-end tests:
the process and a queue of its stdout lines (where it announces its addresses)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
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
