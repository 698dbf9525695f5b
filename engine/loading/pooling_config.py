"""A model's pooling, read from its sentence-transformers files: `modules.json` names a
Pooling module (its folder's `config.json` says mean, CLS or last token) and whether a
Normalize module follows; `sentence_bert_config.json`'s `max_seq_length` bounds the input.
Without them: an encoder pools its [CLS] token, a decoder its last token (as
Qwen3-Embedding and e5-mistral do), both normalised."""
from __future__ import annotations

import json
from pathlib import Path

from engine.layers.pooler import PoolingSpec

_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_cls_token", "cls"),
          ("pooling_mode_mean_tokens", "mean"))


def read_pooling_spec(model_dir: str, encoder: bool) -> PoolingSpec:
    root = Path(model_dir)
    modules = _json(root / "modules.json")
    if not isinstance(modules, list):
        return PoolingSpec(mode="cls" if encoder else "last", normalize=True)
    types = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    normalize = "Normalize" in types
    config = _json(root / types["Pooling"] / "config.json") if "Pooling" in types else None
    if not isinstance(config, dict):
        return PoolingSpec(mode="cls" if encoder else "last", normalize=normalize)
    for key, mode in _MODES:
        if config.get(key):
            return PoolingSpec(mode=mode, normalize=normalize)
    unsupported = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    raise ValueError(f"{model_dir}: unsupported sentence-transformers pooling {unsupported}; "
                     "supported: mean, cls, lasttoken")


def max_seq_length(model_dir: str) -> int | None:
    """sentence-transformers' input bound (it truncates there), when the model has one."""
    config = _json(Path(model_dir) / "sentence_bert_config.json")
    value = config.get("max_seq_length") if isinstance(config, dict) else None
    return int(value) if value else None


def _json(path: Path):
    if not path.exists():
        return None
    return json.loads(path.read_text())
