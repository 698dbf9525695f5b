"""The benchmarks of scripts/ run from tests at toy sizes, on the CPU path (even on a GPU
machine), and the JSON each writes where its --json says."""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, json_path: Path, timeout: float = 300) -> tuple[Any, str]:
    """scripts/`name` with `args` in a fresh process; (the JSON it wrote, its stdout)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args, "--json", str(json_path)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(json_path.read_text()), done.stdout


def run_script_here(name: str, *args: str, json_path: Path, monkeypatch) -> Any:
    """scripts/`name` with `args` in this process (no interpreter and torch start: for the
    scripts on the demo model that run in seconds); the JSON it wrote. The torch threads a
    script sets are set back."""
    import torch

    script = ROOT / "scripts" / name
    monkeypatch.setattr(sys, "argv", [str(script), *args, "--json", str(json_path)])
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    return json.loads(json_path.read_text())
