"""GGUF rope scaling (llama.cpp's `rope.scaling.*` keys) read into the transformers config:
the cos/sin cache equals the one from the same settings in a Hugging Face config."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from engine.layers.rotary import get_rope  # noqa: E402
from engine.models import load_hf_config  # noqa: E402

HEADS, HIDDEN = 4, 64


def write_header(path: Path, **scaling) -> str:
    """A metadata-only Qwen2 GGUF (what the config reads), with `rope.scaling.<key>` values."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(2), writer.add_context_length(512), writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(128), writer.add_head_count(HEADS), writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6), writer.add_rope_freq_base(1e6), writer.add_vocab_size(768)
    for key, value in scaling.items():
        getattr(writer, f"add_rope_scaling_{key}")(value)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.close()
    return str(path)


def test_yarn_gguf_gives_the_hf_yarn_cache(tmp_path):
    from transformers import Qwen2Config

    path = write_header(tmp_path / "yarn.gguf", type=gguf.RopeScalingType.YARN, factor=4.0,
                        orig_ctx_len=128, yarn_beta_fast=16.0, yarn_ext_factor=-1.0)
    ours = get_rope(load_hf_config(path), HIDDEN // HEADS).cos_sin_cache
    hf = Qwen2Config(hidden_size=HIDDEN, num_attention_heads=HEADS, max_position_embeddings=512,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                      "original_max_position_embeddings": 128, "beta_fast": 16.0})
    assert torch.equal(ours, get_rope(hf, HIDDEN // HEADS).cos_sin_cache)
    plain = get_rope(load_hf_config(write_header(tmp_path / "plain.gguf")), HIDDEN // HEADS)
    assert not torch.equal(ours[:512], plain.cos_sin_cache)


def test_linear_gguf_and_refusals(tmp_path):
    linear = load_hf_config(write_header(tmp_path / "lin.gguf", type=gguf.RopeScalingType.LINEAR,
                                         factor=2.0))
    assert get_rope(linear, 16).cos_sin_cache.shape[0] == 512
    with pytest.raises(ValueError, match="GGUF rope scaling 'longrope' is not supported"):
        load_hf_config(write_header(tmp_path / "lr.gguf", type=gguf.RopeScalingType.LONGROPE,
                                    factor=2.0))
    with pytest.raises(ValueError, match=r"rope\.scaling\.yarn_log_multiplier=0\.1\d* is not supported"):
        load_hf_config(write_header(tmp_path / "ds.gguf", type=gguf.RopeScalingType.YARN, factor=4.0,
                                    orig_ctx_len=128, yarn_log_mul=0.1))
