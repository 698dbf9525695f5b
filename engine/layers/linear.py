"""Linear layers, plain or split across tensor-parallel ranks (Megatron style).

Column parallel splits the output features (each rank computes a slice of the outputs);
row parallel splits the input features (each rank computes a partial sum, all-reduced).
Parameters are created with the ambient default dtype and device, and each parameter
carries a `weight_loader` that copies this rank's shard out of a full checkpoint tensor.
At tp size 1 every layer is one `F.linear` call, or at one row on a GPU our Triton GEMV
(`gemv_rows`, engine/kernels/gemv.py), whose K-slice partial sums go unsummed to a consumer
that adds them (`split_sums_ok`, engine/kernels/split_sums.py); an FP8 layer
(engine/quantization/) holds a float8 `weight`, its `weight_scale` and the `quant_method`
that multiplies by them, both set by engine/layers/fp8.py: the layers never import the
quantization, which stands below them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.parallel import Loadable, TPContext, copy_into, divide, materialize, narrow
from engine.kernels.split_sums import SplitSums


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(nn.Module):
    """Holds a [out_local, in_local] weight and optional [out_local] bias."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TPContext | None) -> None:
        super().__init__()
        self.tp = tp or TPContext()
        self.weight = _param(out_local, in_local)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(out_local)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.register_parameter("weight_scale", None)  # set when the layer is FP8
        self.quant_method = None  # set with `weight_scale` (engine/quantization/fp8.py Fp8LinearMethod)
        self.quantize_input = True  # FP8 layers: dynamic per-token activation scales
        self.fast_accum = False  # FP8 layers: `_scaled_mm`'s use_fast_accum (set_fast_accum_)
        self.keep_dtype = False  # never quantized to FP8 (MoE routers)
        # Rows up to which a bf16/fp16 weight multiplies with the Triton GEMV on GPUs (0:
        # never; set by `set_fused_kernels`): it keeps a decode step's PDL chain unbroken.
        self.gemv_rows = 0
        # [gate, up] layers: a float8 GEMV applies SiLU-and-mul itself (`silu_mul_gemv`; set
        # by `set_fused_kernels`).
        self.glu_gemv = False
        # Set by the module that consumes this layer's output when it also takes a GEMV's
        # K-slice partial sums (engine/kernels/split_sums.py) and adds them itself.
        self.split_sums_ok = False
        # LoRA (engine/lora/layer.py's LoRAHook): called with the input and the base output,
        # adds the step's adapters' deltas.
        self.lora = None

    def weight_loader(self, param: nn.Parameter, loaded: Loadable) -> None:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
               keep_splits: bool = False) -> torch.Tensor | SplitSums:
        """x W^T + bias; with `keep_splits` (and no bias) a GEMV's partial sums may come back."""
        if self.lora is not None:
            return self.lora(x, self._dense(x, bias, False))
        return self._dense(x, bias, keep_splits)

    def _dense(self, x: torch.Tensor, bias: torch.Tensor | None,
               keep_splits: bool) -> torch.Tensor | SplitSums:
        keep_splits = keep_splits and bias is None
        if self.weight_scale is None:
            if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= self.gemv_rows:
                from engine.kernels.gemv import gemv

                y = gemv(x, self.weight, keep_splits=keep_splits)
                return y + bias if bias is not None else y
            return F.linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias, keep_splits)

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        return self.matmul(x, self.bias, self.split_sums_ok)


class ReplicatedLinear(LinearBase):
    """The full layer on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPContext | None = None) -> None:
        super().__init__(input_size, output_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: Loadable) -> None:
        copy_into(param, materialize(loaded))


class ColumnParallelLinear(LinearBase):
    """Y = X W^T with W's rows (output features) split across ranks.

    Each rank returns its slice of the outputs, unless `gather_output` concatenates them.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPContext | None = None, gather_output: bool = False) -> None:
        tp = tp or TPContext()
        self.output_size_per_rank = divide(output_size, tp.size, "output size")
        super().__init__(input_size, self.output_size_per_rank, bias, tp)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded: Loadable) -> None:
        n = self.output_size_per_rank
        copy_into(param, narrow(loaded, 0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        gather = self.gather_output and self.tp.size > 1
        y = self.matmul(x, self.bias, self.split_sums_ok and not gather)
        if gather:
            y = self.tp.all_gather(y, dim=-1)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with the same input fused into one matmul (gate/up).

    Each rank's weight is [shard_0 slice of this rank; shard_1 slice of this rank; ...], so
    the outputs split into the per-shard pieces locally, without communication.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TPContext | None = None) -> None:
        tp = tp or TPContext()
        self.local_sizes = [divide(s, tp.size, "output size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def silu_mul_gemv(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a [gate, up] layer in its GEMV's own launch (`gemv_glu`,
        engine/kernels/gemv.py), when its matmul is the float8 weight-only GEMV: one launch
        fewer per MLP. None otherwise, and the caller applies the activation itself. Not for
        bf16: at one row it measured slower fused (H200 W3 4.449 vs 4.341 ms), the split-K
        GEMV keeping more programs in flight than the saved launch is worth."""
        from engine.kernels import gemv as gemv_module

        if (self.glu_gemv and self.weight_scale is not None and self.bias is None
                and self.lora is None and isinstance(x, torch.Tensor) and x.dim() == 2
                and len(self.local_sizes) == 2
                and self.local_sizes[0] == self.local_sizes[1]
                and self.quant_method.takes_weight_only_kernel(x, self.weight_scale)):
            return gemv_module.gemv_glu(x, self.weight, self.weight_scale)
        return None

    def weight_loader(self, param: nn.Parameter, loaded: Loadable, shard_id: int) -> None:
        n = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        copy_into(param.narrow(0, offset, n), narrow(loaded, 0, self.tp.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matmul, split by attention heads.

    Query heads divide across ranks. KV heads divide too while there are at least as many as
    ranks; with more ranks than KV heads each rank keeps one KV head, replicated on
    `size // num_kv_heads` consecutive ranks (GQA groups stay on the rank of their queries).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPContext | None = None) -> None:
        tp = tp or TPContext()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "number of attention heads")
        if tp.size >= num_kv_heads:
            replicas = divide(tp.size, num_kv_heads, "(as KV-head count) tp size")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // replicas
        else:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "number of KV heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, total, bias, tp)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def weight_loader(self, param: nn.Parameter, loaded: Loadable, shard_id: str) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        copy_into(param.narrow(0, offset, size), narrow(loaded, 0, start, size))


class RowParallelLinear(LinearBase):
    """Y = X W^T with W's columns (input features) split: X comes in already split by
    rank (the output of a column-parallel layer), partial sums are all-reduced, then the
    bias (kept whole on every rank) is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPContext | None = None, reduce_results: bool = True) -> None:
        tp = tp or TPContext()
        self.input_size_per_rank = divide(input_size, tp.size, "input size")
        super().__init__(self.input_size_per_rank, output_size, bias, tp)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: Loadable) -> None:
        if param is self.bias:
            copy_into(param, materialize(loaded))
            return
        n = self.input_size_per_rank
        copy_into(param, narrow(loaded, 1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        if self.tp.size == 1:
            return self.matmul(x, self.bias, self.split_sums_ok)
        y = self.matmul(x, None)
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        # Unreduced partial sums get the bias on one rank only, so the later sum adds it once.
        if self.bias is not None and (self.reduce_results or self.tp.rank == 0):
            y = y + self.bias
        return y
