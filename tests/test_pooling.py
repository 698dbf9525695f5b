"""The pooling tasks on the offline engine (no Ray): embeddings of all-MiniLM-L6-v2 (from its
pip package) against sentence-transformers, a tiny random Qwen3 pooled at its last token
against transformers, a tiny random BertForSequenceClassification reranker against
transformers' logits, batching invariance and bad input."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.loading.model_source import resolve_model_path

MINILM = "package:all_minilm_l6_v2"
SENTENCES = [
    "The cat sat on the mat.",
    "Radix caches share prompt prefixes between requests, so a second request that starts "
    "with the same system prompt skips most of its prefill; continuous batching then keeps "
    "the GPU busy while requests of very different lengths come and go.",
    "Hi",
    "Embeddings map text to vectors whose cosine similarity tracks meaning. " * 6,
    "Ray Serve routes HTTP requests to replicas.",
]


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(MINILM, task="embed")


@pytest.fixture(scope="module")
def tiny_reranker(tmp_path_factory) -> str:
    """A random BertForSequenceClassification (one label) with MiniLM's tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("tiny-reranker")
    src = resolve_model_path(MINILM)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{src}/{name}", path / name)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128, num_labels=1)
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(path)
    return str(path)


def assert_embeddings_equal(ours, ref: torch.Tensor) -> None:
    ours = torch.tensor(ours)
    assert ours.shape == ref.shape
    assert F.cosine_similarity(ours, ref).min().item() >= 0.99999
    assert (ours - ref).abs().max().item() <= 1e-5


def test_minilm_equals_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(resolve_model_path(MINILM), device="cpu")
    ref = st.encode(SENTENCES, convert_to_tensor=True)
    ours = minilm.embed(SENTENCES)
    assert_embeddings_equal(ours, ref)
    assert abs(torch.tensor(ours[0]).norm().item() - 1.0) < 1e-5  # its Normalize module


def test_embedding_does_not_depend_on_its_batch(minilm):
    alone = [minilm.embed(s)[0] for s in SENTENCES]
    together = minilm.embed(SENTENCES)
    reversed_ = minilm.embed(SENTENCES[::-1])[::-1]
    # Same input, other neighbours in the packed forward: the same vector to float noise.
    assert_embeddings_equal(together, torch.tensor(alone))
    assert_embeddings_equal(reversed_, torch.tensor(alone))


def test_token_id_inputs_and_truncation(minilm):
    ids = minilm.tokenizer.hf.encode(SENTENCES[1])
    assert_embeddings_equal(minilm.embed([ids]), torch.tensor(minilm.embed(SENTENCES[1:2])))
    long_text = "word " * 400  # over MiniLM's 256-token limit
    with pytest.raises(ValueError, match="more than this model's limit of 256"):
        minilm.embed(long_text)
    cut = minilm.embed(long_text, truncate_prompt_tokens=-1)
    assert len(cut[0]) == 384
    with pytest.raises(ValueError, match="empty"):
        minilm.embed("")
    with pytest.raises(ValueError, match="empty"):
        minilm.embed([])
    with pytest.raises(ValueError, match="Matryoshka"):
        minilm.embed("x", dimensions=8)
    with pytest.raises(ValueError, match="not generation"):
        minilm.generate("hello")
    with pytest.raises(ValueError, match="task='score'"):
        minilm.score("q", ["d"])


def test_decoder_last_token_equals_transformers(tiny_qwen3):
    from transformers import AutoModel

    llm = LLM(tiny_qwen3, task="embed", dtype="float32")
    hf = AutoModel.from_pretrained(tiny_qwen3, torch_dtype=torch.float32).eval()
    seqs = [[5, 9, 14, 3, 7, 2], [11, 4], list(range(3, 40)), [8]]
    ours = llm.embed(seqs)
    ref = []
    with torch.no_grad():
        for s in seqs:
            hidden = hf(torch.tensor([s])).last_hidden_state[0, -1]
            ref.append(F.normalize(hidden, dim=-1))
    assert_embeddings_equal(ours, torch.stack(ref))


def test_base_model_checkpoint_without_prefix_or_head(tiny_qwen3, tmp_path):
    """A Qwen3-Embedding-style checkpoint: the base model's weights (`layers.0...`)."""
    import json

    from transformers import AutoModel

    hf = AutoModel.from_pretrained(tiny_qwen3, torch_dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_qwen3}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    ours = LLM(str(tmp_path), task="embed", dtype="float32").embed([[5, 9, 14], [7]])
    with torch.no_grad():
        ref = [F.normalize(hf(torch.tensor([s])).last_hidden_state[0, -1], dim=-1) for s in ([5, 9, 14], [7])]
    assert_embeddings_equal(ours, torch.stack(ref))


def test_reranker_scores_equal_transformers_logits(tiny_reranker):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    llm = LLM(tiny_reranker, task="score")
    query = "what does a radix cache store?"
    docs = ["prompt prefixes as a tree of token ids", "bananas", "a long document " * 20]
    ours = llm.score(query, docs)
    tok = AutoTokenizer.from_pretrained(tiny_reranker)
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_reranker).eval()
    with torch.no_grad():
        enc = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
        ref = hf(**enc).logits[:, 0]
    assert torch.allclose(torch.tensor(ours), ref, atol=1e-5), (ours, ref)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.embed("x")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_decoder_reranker_scores_equal_transformers_logits(tiny_model_factory, tmp_path, family):
    """A decoder *ForSequenceClassification (Qwen3-Reranker converted to one label, a Llama
    classifier): the logit of the pair's last token, as transformers computes it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    base = tiny_model_factory(family)
    config = AutoConfig.from_pretrained(base)
    config.architectures = [type(config).__name__.replace("Config", "ForSequenceClassification")]
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_config(config).to(torch.float32).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{base}/{name}", tmp_path / name)
    llm = LLM(str(tmp_path), task="score", dtype="float32")
    query = "what does a radix cache store?"
    docs = ["prompt prefixes as a tree of token ids", "bananas", "a long document " * 20]
    ours = llm.score(query, docs)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():  # one pair at a time: no padding for transformers to skip
        ref = [hf(**tok(query, d, return_tensors="pt")).logits[0, 0].item() for d in docs]
    assert ours == pytest.approx(ref, abs=1e-4)
    assert len(set(round(x, 4) for x in ours)) == len(docs)  # the documents score apart


def test_task_checks(tiny_qwen3):
    with pytest.raises(ValueError, match="task must be"):
        LLM(tiny_qwen3, task="classify")
    with pytest.raises(ValueError, match="cross-encoder"):
        LLM(tiny_qwen3, task="score")
    with pytest.raises(ValueError, match="task='embed'"):
        LLM(tiny_qwen3, max_total_tokens=64).embed("x")


def test_package_archive_is_extracted_once(tmp_path, monkeypatch):
    from engine.loading.model_source import _package_file

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    first = _package_file("all_minilm_l6_v2")
    assert first.startswith(str(tmp_path)) and (tmp_path / "models").is_dir()
    mtime = (tmp_path / "models").stat().st_mtime_ns
    assert _package_file("all_minilm_l6_v2") == first
    assert (tmp_path / "models").stat().st_mtime_ns == mtime  # nothing written again


def test_matryoshka_dimensions_cut_then_normalise(tiny_model_factory):
    path = tiny_model_factory("qwen3", matryoshka_dimensions=[16, 32])
    llm = LLM(path, task="embed", dtype="float32")
    full = torch.tensor(llm.embed([[5, 6, 7]])[0])
    hf_hidden = 64  # the tiny demo models' hidden size
    assert full.shape == (hf_hidden,)
    cut = torch.tensor(llm.embed([[5, 6, 7]], dimensions=16)[0])
    # Cut before normalising: the first 16 of the raw vector, renormalised.
    assert torch.allclose(cut, F.normalize(full[:16], dim=0), atol=1e-6)
    with pytest.raises(ValueError, match="within 1-64"):
        llm.embed("x", dimensions=65)


def test_concurrent_requests_share_forwards_and_a_left_one_is_dropped(minilm):
    import asyncio

    from engine import AsyncPooling, embedding_inputs

    engine = minilm.pooling.engine
    pooling = AsyncPooling(engine)
    alone = torch.tensor(minilm.embed(SENTENCES))

    async def main():
        started = engine.stats.forwards
        jobs = [pooling.run(embedding_inputs(engine, s)) for s in SENTENCES * 4]
        left = asyncio.ensure_future(pooling.run(embedding_inputs(engine, "gone")))
        left.cancel()
        results = await asyncio.gather(*jobs)
        return results, engine.stats.forwards - started

    try:
        before = engine.stats.inputs
        results, forwards = asyncio.run(main())
        assert forwards < len(SENTENCES) * 4  # packed: fewer forwards than requests
        assert engine.stats.inputs - before == len(SENTENCES) * 4  # the cancelled one never ran
        for i, r in enumerate(results):
            assert_embeddings_equal([r[0].tolist()], alone[i % len(SENTENCES)][None])
    finally:
        pooling.shutdown()


def test_shutdown_fails_the_jobs_still_waiting(minilm):
    """The worker stops after its round in progress; every job still queued fails instead
    of hanging, and so does a job sent after the stop."""
    import asyncio

    from engine import AsyncPooling, embedding_inputs

    engine = minilm.pooling.engine
    pooling = AsyncPooling(engine)

    async def main():
        # Alternate Matryoshka cuts: a round takes jobs of one cut, so each is a round.
        jobs = [asyncio.ensure_future(pooling.run(embedding_inputs(engine, s), (None, 128)[i % 2]))
                for i, s in enumerate(SENTENCES * 20)]
        started = engine.stats.forwards
        while engine.stats.forwards == started:  # queued, and a first round has run
            await asyncio.sleep(0.005)
        pooling.shutdown(timeout=30)
        outcomes = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 30)
        with pytest.raises(RuntimeError, match="stopped"):
            await asyncio.wait_for(pooling.run(embedding_inputs(engine, "late")), 30)
        return outcomes

    outcomes = asyncio.run(main())
    assert not pooling.is_alive()
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert failed and all(isinstance(o, RuntimeError) and "stopped" in str(o) for o in failed)
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    assert done and len(done) + len(failed) == len(outcomes)  # the rounds before the stop ran


@pytest.mark.gpu
def test_minilm_on_the_gpu_equals_sentence_transformers():
    from sentence_transformers import SentenceTransformer

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    # A GPU machine without the package is given a copy of the model's folder (test plumbing).
    model = os.environ.get("RADIXSERVE_TEST_MINILM_DIR")
    if model is None:
        pytest.importorskip("all_minilm_l6_v2", reason="the MiniLM package, or "
                            "RADIXSERVE_TEST_MINILM_DIR naming a copy of its folder")
        model = MINILM
    st = SentenceTransformer(resolve_model_path(model), device="cuda")
    ref = st.encode(SENTENCES, convert_to_tensor=True).float().cpu()
    ours = torch.tensor(LLM(model, task="embed", dtype="float32", device="cuda").embed(SENTENCES))
    assert F.cosine_similarity(ours, ref).min().item() >= 0.9999  # TF32 matmuls on both sides
    bf16 = torch.tensor(LLM(model, task="embed", dtype="bfloat16", device="cuda").embed(SENTENCES))
    assert F.cosine_similarity(bf16, ref).min().item() >= 0.99


def test_benchmark_smoke_on_tiny_models(tmp_path):
    """scripts/bench_embed.py --tiny (the CPU path): the engine and the padded transformers
    baseline embed every input, and the decoder row pools every input's tokens."""
    from bench_scripts import run_script

    result = run_script("bench_embed.py", "--tiny", json_path=tmp_path / "embed.json")[0]
    (encoder,) = result["encoders"]
    assert encoder["inputs"] == 64 and encoder["tokens"] > 64
    assert encoder["engine_emb_per_s"] > 0 and encoder["hf_padded_emb_per_s"] > 0
    decoder = result["decoder"]
    assert decoder["inputs"] == 32 and decoder["pooling_tok_per_s"] > 0
    assert decoder["engine_prefill_tok_per_s"] > 0
