"""Tiny random HF models for tests and demos, built offline and deterministically.

`build_tiny_model(path, arch)` writes a complete HF model directory: a byte-level BPE
tokenizer trained on the small corpus below (with a ChatML chat template), config.json,
generation_config.json and random weights in model.safetensors. The weights are drawn from
our own seeded generator (not HF's initialisers), so a build is reproducible across
transformers versions. Builds go to a temporary sibling directory that is renamed into
place, so concurrent builders are safe and a finished directory is never half-written.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.config import default_cache_root

BUILD_VERSION = 1  # bump whenever a build's output changes: it names the cache directory
MARKER = ".radixserve-demo.json"
ARCHS = ("llama", "llama3", "qwen2", "qwen3", "mistral")
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The old lighthouse stood at the edge of the harbour, and every evening the keeper climbed
the spiral stairs to light the lamp. Ships that passed in the night saw the beam sweep
across the water, once every twelve seconds, and knew that the rocks were near.

A serving system for language models keeps many requests in flight at the same time. When
two prompts share the same beginning, the work done for the first can be reused for the
second, which saves memory and time. The cache is organised as a tree of tokens.

In the market square the baker sold bread, cakes and small sweet rolls. Children came with
coins in their hands and asked for the biggest roll, and the baker always smiled and gave
them one with extra sugar on the top. The smell of warm bread filled the narrow streets.

The river runs from the mountains to the sea. In spring it is fast and cold, full of melted
snow; in summer it is slow and warm, and people swim in the deep pools under the trees.
Fish swim against the current, and birds wait on the stones to catch them.

To solve a problem, first write down what you know and what you want to find. Then try a
small example by hand, look for a pattern, and check each step. If the answer seems wrong,
go back and read the question again. Good notes make hard problems easier.

She opened the letter slowly. It was from her brother, who had travelled far to the north
to work on the new railway. He wrote about the long winter, the snow that never stopped,
and the friends he had made in the camp. He promised to come home before the summer.

Numbers are everywhere: one, two, three, four, five, six, seven, eight, nine and ten.
The year has twelve months and the week has seven days. A day has twenty four hours, an
hour has sixty minutes, and a minute has sixty seconds.

The computer reads the program one instruction at a time. It loads values from memory,
adds and multiplies them, compares the results, and jumps to another place in the program
when a condition is true. Fast machines do billions of these steps every second.

User: What is the capital of France? Assistant: The capital of France is Paris.
User: Can you tell me a story? Assistant: Once upon a time, there was a little fox who
lived in a green forest and loved to watch the stars at night.
"""


def default_demo_model_dir(arch: str = "llama") -> Path:
    return default_cache_root() / f"demo-{arch}-v{BUILD_VERSION}"


def ensure_demo_model(arch: str = "llama") -> str:
    """The shared demo model directory, built on first use (safe across processes)."""
    return build_tiny_model(default_demo_model_dir(arch), arch)


def build_tiny_model(path: str | Path, arch: str = "llama", *, seed: int = 0,
                     init_std: float = 0.3, **overrides: Any) -> str:
    """Build a tiny random HF model of `arch` at `path` (returned as str); a no-op when
    `path` already holds the same finished build. `overrides` replace HF config fields
    (e.g. num_hidden_layers=4, tie_word_embeddings=True, dtype="bfloat16")."""
    if arch not in ARCHS:
        raise ValueError(f"unknown demo arch {arch!r}; choose one of {ARCHS}")
    path = Path(path)
    spec = _as_json({"version": BUILD_VERSION, "arch": arch, "seed": seed, "init_std": init_std,
                     "overrides": overrides})
    if _finished(path, spec):
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        _build(tmp, arch, seed, init_std, overrides)
        (tmp / MARKER).write_text(json.dumps(spec, sort_keys=True))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by the user's processes
        try:
            os.rename(tmp, path)  # atomic; succeeds onto a missing or empty directory
        except OSError:
            if not _finished(path, spec):  # not a concurrent builder's identical result
                raise FileExistsError(f"{path} exists and is not a radixserve demo build")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def _as_json(value: dict) -> dict:
    # The build spec as it reads back from the marker file (e.g. a torch.dtype becomes a str).
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _finished(path: Path, spec: dict) -> bool:
    marker = path / MARKER
    if not marker.exists():
        return False
    found = json.loads(marker.read_text())
    if found != spec:
        raise ValueError(f"{path} holds a different demo build ({found}); wanted {spec}. "
                         "Delete it or build elsewhere")
    return True


def _build(out: Path, arch: str, seed: int, init_std: float, overrides: dict) -> None:
    tokenizer = _build_tokenizer(out)
    config = _build_config(arch, tokenizer, init_std, overrides)
    config.save_pretrained(out)
    _write_generation_config(out, tokenizer)
    _write_weights(out, config, seed, init_std)


def _build_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=768, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer)
    # Like Llama tokenizers: plain encoding starts with <s> (chat templates add it themselves).
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", chat_template=CHAT_TEMPLATE,
                                   model_max_length=512)
    fast.save_pretrained(out)
    return fast


def _build_config(arch: str, tokenizer: Any, init_std: float, overrides: dict) -> Any:
    import transformers

    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32",
        initializer_range=init_std)
    if arch == "llama":
        cls = transformers.LlamaConfig
    elif arch == "llama3":
        cls = transformers.LlamaConfig
        fields.update(num_hidden_layers=3, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif arch == "mistral":
        cls = transformers.MistralConfig
        fields.update(sliding_window=None)
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
        fields.update(tie_word_embeddings=True, rope_theta=1000000.0)
    else:  # qwen3: head_dim decoupled from hidden_size / heads, as in the real models
        cls = transformers.Qwen3Config
        fields.update(tie_word_embeddings=True, head_dim=32, rope_theta=1000000.0)
    fields.update(overrides)
    config = cls(**fields)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


def _write_generation_config(out: Path, tokenizer: Any) -> None:
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    gen = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos,
           "pad_token_id": tokenizer.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Llama-family checkpoint."""
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    model_type = config.model_type
    attn_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        if model_type == "qwen2" or attn_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if attn_bias and model_type != "qwen2":
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if model_type == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
        if mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                           p + "mlp.down_proj.bias": (h,)})
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _write_weights(out: Path, config: Any, seed: int, std: float) -> None:
    import torch  # only to build the model: a built one is found without it
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, str(getattr(config, "dtype", None) or "float32").replace("torch.", ""))
    tensors = {}
    for name, shape in _weight_shapes(config).items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            # Qwen3 normalises q and k per head; scales above 1 keep attention from being
            # near-uniform, which would make greedy decoding repeat itself.
            t = 2.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith("norm.weight"):
            # Around 1, not exactly 1, so a misplaced norm shows up in the tests.
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = std * torch.randn(shape, generator=gen)
        tensors[name] = t.to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
