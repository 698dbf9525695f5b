"""Compiling a Triton kernel for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter runs a kernel's Python, not Triton's compiler, which is stricter (types
across branches, what lowers to PTX): CPU tests compile each GPU kernel variant here too.
"""
from __future__ import annotations


def compile_for_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int = 4,
                     num_stages: int = 3) -> str:
    """PTX of `fn` compiled for sm_90. `types` gives Triton types by parameter name ("*bf16",
    "fp32", "i32"); other capitalised parameters are int64 pointers (ReqToToken int32), other
    lower-case ones int32 scalars; constexprs unset take their defaults."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    sig = {}
    for prm in fn.params:
        if prm.is_constexpr:
            constexprs.setdefault(prm.name, prm.default)  # as a launch binds defaults
            sig[prm.name] = "constexpr"
        elif prm.name in types:
            sig[prm.name] = types[prm.name]
        elif prm.name[0].isupper():
            sig[prm.name] = "*i32" if prm.name == "ReqToToken" else "*i64"
        else:
            sig[prm.name] = "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v
                                                      for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ptx"]
