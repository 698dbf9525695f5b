"""Our Llama-family models against HF transformers, through the real KV pool and torch backend."""
from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.attention.base import ForwardBatch
from engine.attention.torch_backend import TorchAttentionBackend
from engine.demo_model import MARKER, build_tiny_model, default_demo_model_dir, ensure_demo_model
from engine.kv_pool import KVPool
from engine.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                           RMSNorm, RowParallelLinear, TPContext, VocabParallelEmbedding)
from engine.models import get_model_class, load_hf_config, load_model, resolve_dtype

ATOL = 1e-4


class MiniRunner:
    """Just enough of a model runner to drive the model: a req_to_token table, slot
    allocation from the pool, and ForwardBatch construction for a ragged step."""

    def __init__(self, model, max_requests: int = 8, max_context: int = 128, num_slots: int = 512) -> None:
        self.model = model
        self.pool = KVPool(num_slots, model.num_layers, model.num_kv_heads, model.head_dim, model.dtype, "cpu")
        self.backend = TorchAttentionBackend(self.pool, model.scale)
        model.set_attention_backend(self.backend)
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int32)
        self.kv_lens = [0] * max_requests

    def make_batch(self, new_tokens: dict[int, list[int]]) -> ForwardBatch:
        """One step in which request row r gets the tokens new_tokens[r] (after its cached ones)."""
        rows = list(new_tokens)
        ids, positions, out_slots, seq_lens, extend_lens = [], [], [], [], []
        for row in rows:
            tokens, prefix = new_tokens[row], self.kv_lens[row]
            slots = self.pool.allocator.alloc(len(tokens))
            self.req_to_token[row, prefix:prefix + len(tokens)] = torch.tensor(slots, dtype=torch.int32)
            ids += tokens
            positions += range(prefix, prefix + len(tokens))
            out_slots += slots
            self.kv_lens[row] = prefix + len(tokens)
            seq_lens.append(self.kv_lens[row])
            extend_lens.append(len(tokens))
        indptr = [0]
        for n in extend_lens:
            indptr.append(indptr[-1] + n)
        return ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(positions), out_slots=torch.tensor(out_slots),
            req_rows=torch.tensor(rows), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            extend_lens=torch.tensor(extend_lens, dtype=torch.int32),
            qo_indptr=torch.tensor(indptr, dtype=torch.int32),
            logits_indices=torch.tensor(indptr[1:]) - 1, req_to_token=self.req_to_token,
            is_decode=all(n == 1 for n in extend_lens), seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens)

    @torch.inference_mode()
    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Logits [n_new, vocab] of every new token, per request row."""
        batch = self.make_batch(new_tokens)
        self.backend.prepare(batch)
        logits = self.model.compute_logits(self.model(batch))
        assert logits.dtype == torch.float32
        bounds = batch.qo_indptr.tolist()
        return {row: logits[bounds[i]:bounds[i + 1]] for i, row in enumerate(new_tokens)}


def hf_logits(path: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf(torch.tensor([seq])).logits[0].float() for seq in sequences]


def random_sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)


MODEL_CASES = [
    ("llama", {}),
    ("llama3", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
]


@pytest.mark.parametrize("arch,overrides", MODEL_CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(sorted(c)) or "base")
def test_matches_hf_prefill_decode_and_chunks(tiny_model_factory, arch, overrides):
    path = tiny_model_factory(arch, **overrides)
    model = load_model(path, dtype="float32", device="cpu")
    prompt_lens, n_decode = [5, 11, 17], 3
    seqs = random_sequences(model.config.vocab_size, [n + n_decode for n in prompt_lens])
    # Request 3 is request 2's sequence again, to be prefilled in two chunks.
    ref = hf_logits(path, seqs)
    runner = MiniRunner(model)

    # Ragged prefill of three prompts.
    out = runner.step({r: seqs[r][:prompt_lens[r]] for r in range(3)})
    for r in range(3):
        assert_close(out[r], ref[r][:prompt_lens[r]])
    # Decode steps, one token per request.
    for j in range(n_decode):
        out = runner.step({r: [seqs[r][prompt_lens[r] + j]] for r in range(3)})
        for r in range(3):
            assert_close(out[r][0], ref[r][prompt_lens[r] + j])

    # Chunked prefill: the prefix chunk alone, then the rest beside a decoding request
    # (a mixed step: one extend of several tokens and one of a single token).
    full, cut = seqs[2], 7
    out = runner.step({3: full[:cut]})
    assert_close(out[3], ref[2][:cut])
    out = runner.step({3: full[cut:], 4: seqs[0][:1]})
    assert_close(out[3], ref[2][cut:])
    assert_close(out[4], ref[0][:1])


def test_last_token_logits_and_backend_swap(tiny_qwen3):
    """compute_logits on the last tokens only; a backend set after construction is used."""
    model = load_model(tiny_qwen3, dtype="float32", device="cpu")
    seqs = random_sequences(model.config.vocab_size, [4, 9], seed=1)
    ref = hf_logits(tiny_qwen3, seqs)
    runner = MiniRunner(model)  # sets the backend on an already built model
    batch = runner.make_batch({0: seqs[0], 1: seqs[1]})
    with torch.inference_mode():
        hidden = model(batch)
        assert hidden.shape == (13, model.config.hidden_size)
        logits = model.compute_logits(hidden[batch.logits_indices])
    assert logits.shape == (2, model.config.vocab_size)
    assert_close(logits[0], ref[0][-1])
    assert_close(logits[1], ref[1][-1])


def test_greedy_output_is_not_degenerate(tiny_model_any):
    """The random demo weights must give varied greedy continuations, not one token repeated."""
    from transformers import AutoTokenizer

    _, path = tiny_model_any
    tok = AutoTokenizer.from_pretrained(path)
    runner = MiniRunner(load_model(path, dtype="float32", device="cpu"))
    prompts = ["The river runs", "Once upon a time", "User: What is the capital of France?"]
    reqs = {r: tok(p).input_ids for r, p in enumerate(prompts)}
    outputs: dict[int, list[int]] = {r: [] for r in reqs}
    for _ in range(24):
        logits = runner.step(reqs)
        reqs = {r: [int(lg[-1].argmax())] for r, lg in logits.items()}
        for r, t in reqs.items():
            outputs[r] += t
    for toks in outputs.values():
        longest_run = max(sum(1 for _ in g) for _, g in itertools.groupby(toks))
        assert len(set(toks)) >= 12 and longest_run <= 3, tok.decode(toks)
    assert len({tuple(t) for t in outputs.values()}) == len(outputs)


def test_tied_embeddings_share_the_weight(tiny_qwen2, tiny_llama):
    tied = load_model(tiny_qwen2, dtype="float32", device="cpu")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = load_model(tiny_llama, dtype="float32", device="cpu")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    with safe_open(str(Path(tiny_llama) / "model.safetensors"), "pt") as f:
        torch.testing.assert_close(untied.lm_head.weight, f.get_tensor("lm_head.weight"))


def test_dummy_load_is_deterministic(tiny_qwen3):
    a = load_model(tiny_qwen3, dtype="float32", device="cpu", load_format="dummy", seed=3)
    b = load_model(tiny_qwen3, dtype="float32", device="cpu", load_format="dummy", seed=3)
    c = load_model(tiny_qwen3, dtype="float32", device="cpu", load_format="dummy", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.all(pa == 1), name
        else:
            assert not torch.equal(pa, pc), name
            assert 0.01 < pa.std() < 0.03, name
    runner = MiniRunner(a)
    out = runner.step({0: [5, 6, 7]})
    assert torch.isfinite(out[0]).all()


def test_load_model_dtypes_and_errors(tiny_llama, tmp_path):
    cfg = load_hf_config(tiny_llama)
    assert resolve_dtype("auto", cfg, "cpu") == torch.float32
    assert resolve_dtype("auto", cfg, "cuda") == torch.float32  # the config's dtype
    cfg.dtype = torch.bfloat16
    assert resolve_dtype("auto", cfg, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", cfg, "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cfg, "cpu")

    model = load_model(tiny_llama, dtype="bfloat16", device="cpu")
    assert model.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # restored after the build

    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        get_model_class(cfg)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((Path(tiny_llama) / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(empty), device="cpu")
    assert load_model(str(empty), device="cpu", load_format="dummy").dtype == torch.float32


def test_missing_checkpoint_weight_is_an_error(tiny_llama, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((Path(tiny_llama) / "config.json").read_text())
    with safe_open(str(Path(tiny_llama) / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if "layers.1.self_attn.k_proj" not in k}
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        load_model(str(ckpt), device="cpu")


# ---- tensor-parallel sharding, checked rank by rank without collectives ----

def _slices_of(tensors: dict[str, torch.Tensor], tmp_path: Path):
    """Lazy safetensors slices of `tensors`, as the loader hands them to ranks at tp > 1."""
    file = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file))
    handle = safe_open(str(file), "pt")
    return handle, {k: handle.get_slice(k) for k in tensors}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_recombine_to_the_dense_layer(tmp_path, tp_size):
    torch.manual_seed(0)
    hidden, head_dim, n_heads, n_kv, inter, vocab = 16, 4, 4, 2, 24, 37
    full = {"q": torch.randn(n_heads * head_dim, hidden), "k": torch.randn(n_kv * head_dim, hidden),
            "v": torch.randn(n_kv * head_dim, hidden), "qb": torch.randn(n_heads * head_dim),
            "gate": torch.randn(inter, hidden), "up": torch.randn(inter, hidden),
            "down": torch.randn(hidden, inter), "down_b": torch.randn(hidden), "emb": torch.randn(vocab, hidden)}
    handle, sl = _slices_of(full, tmp_path)
    x = torch.randn(3, hidden)
    ids = torch.tensor([0, 5, 19, 36])
    q_parts, k_parts, act_parts, row_sum, emb_sum, logit_parts = [], [], [], 0, 0, []
    for rank in range(tp_size):
        tp = TPContext(rank, tp_size)
        qkv = QKVParallelLinear(hidden, head_dim, n_heads, n_kv, bias=True, tp=tp)
        for sid, key in (("q", "q"), ("k", "k"), ("v", "v")):
            qkv.weight.weight_loader(qkv.weight, sl[key], sid)
        qkv.bias.zero_()
        qkv.bias.weight_loader(qkv.bias, sl["qb"], "q")
        q, k, v = qkv.split(qkv(x))
        q_parts.append(q)
        k_parts.append(k)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], tp=tp)
        gate_up.weight.weight_loader(gate_up.weight, sl["gate"], 0)
        gate_up.weight.weight_loader(gate_up.weight, sl["up"], 1)
        act = gate_up(x)
        act_parts.append(act)
        down = RowParallelLinear(inter, hidden, bias=True, tp=tp)
        down.weight.weight_loader(down.weight, sl["down"])
        down.bias.weight_loader(down.bias, sl["down_b"])
        g, u = act.chunk(2, dim=-1)
        row_sum = row_sum + torch.nn.functional.linear(g * u, down.weight)  # the all-reduce, by hand
        emb = VocabParallelEmbedding(vocab, hidden, tp=tp)
        emb.weight.weight_loader(emb.weight, sl["emb"])
        local = ids - emb.vocab_start
        inside = (local >= 0) & (local < emb.vocab_per_rank)
        emb_sum = emb_sum + torch.where(inside[:, None], emb.weight[local.clamp(0, emb.vocab_per_rank - 1)], 0)
        head = ParallelLMHead(vocab, hidden, tp=tp)
        head.weight.weight_loader(head.weight, sl["emb"])
        logit_parts.append(torch.nn.functional.linear(x, head.weight))
        col = ColumnParallelLinear(hidden, inter, tp=tp)
        col.weight.weight_loader(col.weight, sl["gate"])
        torch.testing.assert_close(col(x), x @ full["gate"][rank * inter // tp_size:(rank + 1) * inter // tp_size].T)
    handle.__exit__(None, None, None)

    torch.testing.assert_close(torch.cat(q_parts, -1), x @ full["q"].T + full["qb"])
    kv_heads = [k_parts[r].view(3, -1, head_dim) for r in range(tp_size)]
    replicas = max(1, tp_size // n_kv)
    ref_k = (x @ full["k"].T).view(3, n_kv, head_dim)
    for r in range(tp_size):  # with more ranks than KV heads, each rank keeps its queries' KV head
        first = (r // replicas) * (n_kv // min(n_kv, tp_size))
        torch.testing.assert_close(kv_heads[r], ref_k[:, first:first + kv_heads[r].shape[1]])
    gates = torch.cat([a.chunk(2, -1)[0] for a in act_parts], -1)
    torch.testing.assert_close(gates, x @ full["gate"].T)
    g, u = x @ full["gate"].T, x @ full["up"].T
    torch.testing.assert_close(row_sum + full["down_b"], (g * u) @ full["down"].T + full["down_b"])
    torch.testing.assert_close(emb_sum, full["emb"][ids])
    torch.testing.assert_close(torch.cat(logit_parts, -1)[:, :vocab], x @ full["emb"].T)


def test_tp_size_one_layers_are_dense():
    tp = TPContext()
    assert tp.all_reduce(x := torch.ones(2)) is x and tp.all_gather(x) is x
    layer = RowParallelLinear(8, 4, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)
    norm = RMSNorm(8)
    y, res = norm(x, torch.ones_like(x))
    torch.testing.assert_close(res, x + 1)
    torch.testing.assert_close(y, norm(x + 1))
    with pytest.raises(ValueError, match="divisible"):
        QKVParallelLinear(16, 4, 4, 2, tp=TPContext(0, 3))


# ---- the demo model builder ----

def test_build_is_deterministic_and_idempotent(tmp_path):
    a = build_tiny_model(tmp_path / "a", "qwen2")
    b = build_tiny_model(tmp_path / "b", "qwen2")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name
    assert build_tiny_model(a, "qwen2") == a
    with pytest.raises(ValueError, match="different demo build"):
        build_tiny_model(a, "llama")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_model(tmp_path / "junk", "llama")


def test_concurrent_builds_and_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    target = default_demo_model_dir("llama")
    assert target.parent == tmp_path / "cache"
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_demo_model("llama"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [str(target)] * 3
    assert (target / MARKER).exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temp dirs left


def test_tokenizer_and_chat_template(tiny_llama):
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert 500 <= len(tok) <= 1000 and len(tok) == load_hf_config(tiny_llama).vocab_size
    ids = tok("The river runs to the sea.").input_ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "The river runs to the sea."
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((Path(tiny_llama) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
