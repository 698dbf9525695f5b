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
from engine.loading.demo_model import MARKER, build_tiny_model, default_demo_model_dir, ensure_demo_model
from engine.attention.kv_pool import KVPool
from engine.layers import (ParallelLMHead, QKVParallelLinear, RMSNorm, RowParallelLinear, TPContext,
                           VocabParallelEmbedding)
from engine.models import get_model_class, load_hf_config, load_model, resolve_dtype

ATOL = 1e-4


class MiniRunner:
    """Just enough of a model runner to drive the model: a req_to_token table, slot
    allocation from the pool, and ForwardBatch construction for a ragged step."""

    def __init__(self, model, max_requests: int = 8, max_context: int = 128,
                 num_slots: int = 512) -> None:
        self.model = model
        self.device = model.device
        self.pool = KVPool(num_slots, model.num_layers, model.num_kv_heads, model.head_dim, model.dtype,
                           self.device)
        self.backend = TorchAttentionBackend(self.pool, model.scale)
        model.set_attention_backend(self.backend)
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int32, device=self.device)
        self.kv_lens = [0] * max_requests

    def share_prefix(self, src_row: int, dst_row: int, n: int) -> None:
        """Give dst_row the KV slots of src_row's first n tokens (a radix-cache hit)."""
        self.req_to_token[dst_row, :n] = self.req_to_token[src_row, :n]
        self.kv_lens[dst_row] = n

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
        def t(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=self.device)

        return ForwardBatch(
            input_ids=t(ids), positions=t(positions), out_slots=t(out_slots), req_rows=t(rows),
            seq_lens=t(seq_lens, torch.int32), extend_lens=t(extend_lens, torch.int32),
            qo_indptr=t(indptr, torch.int32), logits_indices=t(indptr[1:]) - 1,
            req_to_token=self.req_to_token, is_decode=all(n == 1 for n in extend_lens),
            seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens)

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
    # Sliding windows shorter than the sequences: every layer (Mistral), or the layers from
    # max_window_layers on (Qwen2's layer_types).
    ("mistral", {"sliding_window": 6}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    # YaRN with an original context of 8: the sequences here (up to 20 tokens) run past it.
    ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                   "original_max_position_embeddings": 8, "beta_fast": 16,
                                   "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}}),
]


@pytest.mark.parametrize("arch,overrides", MODEL_CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(sorted(c)) or "base")
def test_matches_hf_prefill_decode_and_chunks(tiny_model_factory, arch, overrides):
    path = tiny_model_factory(arch, **overrides)
    model = load_model(path, dtype="float32", device="cpu")
    prompt_lens, n_decode = [5, 11, 17], 3
    seqs = random_sequences(model.config.vocab_size, [n + n_decode for n in prompt_lens])
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

    # Chunked prefill of sequence 2 again (row 3), beside a new short request (row 4): the
    # second step mixes a chunk on top of cached KV with row 4's first decode token.
    full, cut = seqs[2], 7
    out = runner.step({3: full[:cut], 4: seqs[0][:4]})
    assert_close(out[3], ref[2][:cut])
    assert_close(out[4], ref[0][:4])
    out = runner.step({3: full[cut:], 4: seqs[0][4:5]})
    assert_close(out[3], ref[2][cut:])
    assert_close(out[4], ref[0][4:5])

    # Prefix reuse, as the radix cache does it: row 5 points at row 2's KV slots for the
    # first `cut` tokens and computes only the rest.
    runner.share_prefix(src_row=2, dst_row=5, n=cut)
    out = runner.step({5: full[cut:]})
    assert_close(out[5], ref[2][cut:])


def test_bfloat16_is_as_close_to_float32_as_hf_bfloat16(tiny_llama):
    """bf16 runs end to end (bf16 KV pool) with no more error than HF's own bf16 forward."""
    from transformers import AutoModelForCausalLM

    seqs = random_sequences(768, [6, 13], seed=2)
    ref = hf_logits(tiny_llama, seqs)
    hf16 = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    runner = MiniRunner(load_model(tiny_llama, dtype="bfloat16", device="cpu"))
    out = runner.step({0: seqs[0], 1: seqs[1]})
    with torch.inference_mode():
        for r, seq in enumerate(seqs):
            hf_err = (hf16(torch.tensor([seq])).logits[0].float() - ref[r]).abs().mean()
            our_err = (out[r] - ref[r]).abs().mean()
            assert our_err <= 1.5 * hf_err, (our_err, hf_err)


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


YARN_CASES = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 100, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16,
     "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "attention_factor": 0.9},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128},  # 512 / 128
]


@pytest.mark.parametrize("params", YARN_CASES, ids=range(len(YARN_CASES)))
def test_yarn_frequencies_and_attention_factor_equal_transformers(params):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rotary import attention_factor, get_rope, inverse_frequencies, rope_parameters

    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=512,
                      rope_parameters={"rope_theta": 1e6, **params})
    ours = rope_parameters(cfg)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert torch.equal(inverse_frequencies(32, ours), ref_inv_freq)
    assert attention_factor(ours) == pytest.approx(ref_factor, rel=1e-12)
    cache = get_rope(cfg, 32).cos_sin_cache
    assert cache.shape[0] >= 512 and cache[0, :16].unique().tolist() == [pytest.approx(ref_factor)]


def test_yarn_cache_covers_the_scaled_context(tiny_model_factory):
    """Qwen's YaRN recipe keeps max_position_embeddings at the original length: positions up
    to original x factor must still have cos/sin rows (max_model_len raised to use them)."""
    from transformers import Qwen2Config

    from engine.layers.rotary import get_rope

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                      rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    assert get_rope(cfg, 16).cos_sin_cache.shape[0] == 512


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_yarn_greedy_equals_hf_past_the_original_context(tiny_model_factory, arch):
    from engine import LLM, SamplingParams
    from hf_reference import hf_greedy

    path = tiny_model_factory(arch, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 16})
    prompts = random_sequences(768, [12, 30], seed=5)  # 12 + 12 crosses 16; 30 starts past it
    llm = LLM(model=path, dtype="float32", max_total_tokens=1024)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 12) for p in prompts]


@pytest.mark.parametrize("arch,overrides", [
    ("mistral", {"sliding_window": 8}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
])
def test_sliding_window_greedy_equals_hf(tiny_model_factory, arch, overrides):
    from engine import LLM, SamplingParams
    from hf_reference import hf_greedy

    path = tiny_model_factory(arch, **overrides)
    prompts = random_sequences(768, [5, 20], seed=6)  # decoding into, and far past, the window
    llm = LLM(model=path, dtype="float32", max_total_tokens=1024)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 12) for p in prompts]


class _FullAttentionOnly:
    """A backend without sliding windows: the torch backend's results, windows unread."""

    def __init__(self, inner: TorchAttentionBackend) -> None:
        self.inner = inner

    def prepare(self, batch) -> None:
        pass

    def forward(self, q, k, v, layer_id, batch):
        return self.inner.forward(q, k, v, layer_id, batch)


def test_backend_without_windows_is_refused_once_the_context_outgrows_them(tiny_model_factory):
    path = tiny_model_factory("mistral", sliding_window=6)
    model = load_model(path, dtype="float32", device="cpu")
    runner = MiniRunner(model, max_context=32)
    model.set_attention_backend(_FullAttentionOnly(runner.backend))
    with pytest.raises(ValueError, match=r"sliding_window=6: _FullAttentionOnly has no sliding-window "
                                         r"attention .* max_model_len <= 6 or use attention_backend='torch'"):
        runner.step({0: [5, 6, 7]})
    # A context limit within the window: full attention is exact, so it runs.
    runner = MiniRunner(model, max_context=6)
    model.set_attention_backend(_FullAttentionOnly(runner.backend))
    seq = random_sequences(768, [6], seed=2)[0]
    assert_close(torch.cat([runner.step({0: seq[:4]})[0], runner.step({0: seq[4:]})[0]]),
                 hf_logits(path, [seq])[0])
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend

    assert TritonAttentionBackend.supports_sliding_window  # tests/test_triton_window.py


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


# ---- tensor parallelism, simulated: one thread per rank, collectives through shared memory ----

class ThreadGroup:
    """In-process stand-in for a process group: ranks swap tensors through a barrier."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list = [None] * size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        return parts


class ThreadTP(TPContext):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.group.exchange(self.rank, x)
        total = parts[0]
        for p in parts[1:]:  # in rank order, so every rank gets bit-identical sums
            total = total + p
        return total

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.group.exchange(self.rank, x), dim=dim)


def run_ranks(tp_size: int, fn) -> list:
    """fn(tp) on tp_size threads at once; the ranks' results in order."""
    group = ThreadGroup(tp_size)
    results: list = [None] * tp_size

    def work(rank: int) -> None:
        try:
            results[rank] = fn(ThreadTP(rank, tp_size, group))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            results[rank] = e
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, threading.BrokenBarrierError):
            raise r
    return results


@pytest.mark.parametrize("arch,tp_size", [("llama", 2), ("qwen2", 4), ("qwen3", 2)])
def test_tensor_parallel_model_matches_single_rank(tiny_model_factory, arch, tp_size):
    """Each rank loads only its slices (lazy safetensors reads); with the collectives, the
    ranks' logits equal the single-rank model's. At tp=4 the 2 KV heads are replicated."""
    path = tiny_model_factory(arch)
    assert_ranks_match_single(tp_size, lambda tp: load_model(path, dtype="float32", device="cpu", tp=tp))


def assert_ranks_match_single(tp_size: int, load) -> None:
    """`load(tp)` -> a model; at tp_size ranks (threads) a prefill and a decode step give
    every rank the logits of the single-rank model."""
    seqs = random_sequences(768, [5, 9], seed=3)

    def logits_at(tp: TPContext) -> list[torch.Tensor]:
        runner = MiniRunner(load(tp))
        out = runner.step({0: seqs[0][:-1], 1: seqs[1][:-1]})
        out2 = runner.step({0: seqs[0][-1:], 1: seqs[1][-1:]})
        return [torch.cat([out[r], out2[r]]) for r in (0, 1)]

    ref = logits_at(TPContext())
    for rank_logits in run_ranks(tp_size, logits_at):
        for ours, expected in zip(rank_logits, ref):
            assert_close(ours, expected)


def test_vocab_parallel_pads_an_uneven_vocabulary():
    vocab, hidden, tp_size = 37, 8, 4
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 9, 10, 29, 30, 36])
    x = torch.randn(2, hidden)

    def run(tp: TPContext) -> tuple[torch.Tensor, torch.Tensor]:
        emb, head = VocabParallelEmbedding(vocab, hidden, tp), ParallelLMHead(vocab, hidden, tp)
        emb.weight.weight_loader(emb.weight, table)
        head.weight.weight_loader(head.weight, table)
        return emb(ids), head.compute_logits(x)

    for embedded, logits in run_ranks(tp_size, run):
        torch.testing.assert_close(embedded, table[ids])
        torch.testing.assert_close(logits, x @ table.T)


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
    threads = [threading.Thread(target=lambda: results.append(ensure_demo_model("llama")))
               for _ in range(3)]
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
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "The river runs to the sea."
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((Path(tiny_llama) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
