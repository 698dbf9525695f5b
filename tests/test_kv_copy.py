"""The host tier's copy kernel (engine/kernels/kv_copy.py) and its transfers
(engine/executor/kv_transfer.py) on a GPU: device rows to pinned host rows and back, bit
for bit, for bf16 and float8 pools; then an engine on the GPU whose prefixes come back
from the host gives the tokens and logprobs of one whose prefixes stayed on the device.
`TRITON_INTERPRET=1` runs the kernel tests on the CPU (tests/test_kv_copy_cpu.py)."""
from __future__ import annotations

import pytest
import torch

from engine.attention.kv_pool import KVPool
from engine.quantization.fp8 import FP8
from test_triton_attention import DEVICE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"),
]


@pytest.mark.parametrize("dtype, heads, dim", [(torch.bfloat16, 8, 128), (FP8, 2, 64),
                                               (torch.float16, 1, 3)])
def test_rows_copy_between_device_and_pinned_host_memory(dtype, heads, dim):
    from engine.kernels.kv_copy import copy_rows

    torch.manual_seed(0)
    pinned = DEVICE == "cuda"
    dev = torch.randn(64, heads, dim, device=DEVICE).to(dtype)
    host = torch.zeros(48, heads, dim, dtype=dtype, pin_memory=pinned)
    src = torch.tensor([5, 1, 63, 7, 30], device=DEVICE)
    dst = torch.tensor([2, 47, 3, 9, 1], device=DEVICE)
    copy_rows(dev, host, src, dst)
    if pinned:
        torch.cuda.synchronize()
    assert torch.equal(host[dst.cpu()].view(torch.uint8), dev[src].cpu().view(torch.uint8))
    back = torch.zeros_like(dev)
    copy_rows(host, back, dst, src)
    if pinned:
        torch.cuda.synchronize()
    assert torch.equal(back[src].view(torch.uint8), dev[src].view(torch.uint8))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[src.cpu()] = False
    assert not back.cpu()[untouched].float().any()


def test_transfers_queue_on_their_stream_and_keep_the_bytes():
    from engine.executor.kv_transfer import KVTransfer

    pool = KVPool(100, 3, 2, 16, torch.bfloat16, DEVICE)
    for t in pool.k + pool.v:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    transfer = KVTransfer(pool, 50)
    assert transfer.kernel_ok == (DEVICE == "cuda"), "the kernel cannot reach pinned memory"
    want = [t[[4, 5, 6]].clone() for t in pool.k + pool.v]
    transfer.write_back([4, 5, 6], [10, 11, 12])
    for t in pool.k + pool.v:
        t[[4, 5, 6]] = 0  # queued after the copy on the compute stream: the copy saw the values
    transfer.load([10, 11, 12], [90, 91, 92])
    got = [t[[90, 91, 92]] for t in pool.k + pool.v]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    transfer.synchronize()
    assert transfer.stats.loads == 1 and transfer.stats.write_back_bytes == 3 * 3 * 2 * 2 * 16 * 2


@pytest.mark.skipif(DEVICE != "cuda", reason="an engine on the GPU")
def test_gpu_engine_host_tier_matches_the_device_tier():
    from engine import LLM
    from engine.loading.demo_model import ensure_demo_model
    from test_host_tier import conversations, multi_turn

    convs = conversations(4, 300, 400, seed=3)
    common = dict(model=ensure_demo_model(), dtype="bfloat16", chunked_prefill_size=256)
    tiered = LLM(max_total_tokens=700, host_kv_cache_gb=0.1, **common)
    roomy = LLM(max_total_tokens=8000, **common)
    got, ref = multi_turn(tiered, convs), multi_turn(roomy, convs)
    assert tiered.stats()["host_cached_tokens"] >= 4 * 300
    assert [(o.token_ids, o.logprobs, o.cached_tokens) for o in got] == \
        [(o.token_ids, o.logprobs, o.cached_tokens) for o in ref]
