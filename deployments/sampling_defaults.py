"""The model's recommended sampling settings (generation_config.json), applied to requests
that leave them unset: request value > model default > engine default, as SGLang does.

Only the settings that shape the distribution are taken (SGLang's set); `do_sample: false`
is not read as "greedy": a client that wants greedy asks for temperature 0.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_path: str) -> dict[str, Any]:
    """The KEYS that the model directory's generation_config.json sets ({} if none)."""
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    return {k: config[k] for k in KEYS if config.get(k) is not None}


def with_defaults(kwargs: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The request's SamplingParams kwargs, with model defaults where it set nothing."""
    return {**defaults, **kwargs} if defaults else kwargs
