"""GPU kernels checked on a machine without a GPU, two ways:
- `run_under_interpreter`: a file of `gpu`-marked kernel tests run through TRITON_INTERPRET=1;
- `compile_for_sm90`: a kernel compiled for Hopper. The interpreter runs a kernel's Python,
  not Triton's compiler, which is stricter (types across branches, what lowers to PTX).
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_under_interpreter(test_file: str, allow_skipped: bool = False, select: str = "") -> None:
    """Run tests/`test_file`'s `gpu` tests (those `select` picks, as pytest's -k) on the CPU
    through Triton's interpreter, in a fresh process; assert they passed (and, unless
    `allow_skipped`, that none was skipped)."""
    code, out = _interpreter_runs().run(
        ["-q", "-p", "no:cacheprovider", "-m", "gpu", "-W", "ignore::RuntimeWarning",
         str(ROOT / "tests" / test_file)] + (["-k", select] if select else []), timeout=300)
    ok = code == 0 and " passed" in out
    assert ok and (allow_skipped or "skipped" not in out), out[-6000:]


_server = None


def _interpreter_runs():
    """The session's fork server for interpreter runs (tests/pytest_fork_server.py). No
    plugin autoload: the kernel files use none, and loading them costs ~2 s a run."""
    global _server
    if _server is None:
        from pytest_fork_server import ForkServer

        _server = ForkServer(dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
                                  PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))
    return _server


def compile_for_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int = 4,
                     num_stages: int = 3) -> str:
    """PTX of `fn` compiled for sm_90. `types` gives Triton types by parameter name ("*bf16",
    "fp32", "i32"); other capitalised parameters are int64 pointers (ReqToToken int32), other
    lower-case ones int32 scalars; constexprs unset take their defaults, except `PDL`, which is
    on as on an H200 (engine/kernels/launch.py), and then checked to come before any global
    memory access. Also checks the kernel fits a block's shared memory on sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    check_pdl = "PDL" in fn.arg_names and "PDL" not in constexprs
    if check_pdl:
        constexprs["PDL"] = True
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
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    assert kernel.metadata.shared <= H100_SHARED_BYTES, \
        f"{fn.__name__}: {kernel.metadata.shared} bytes of shared memory, past Hopper's"
    ptx = kernel.asm["ptx"]
    if check_pdl:
        assert_waits_before_memory(ptx, fn.__name__)
    return ptx


H100_SHARED_BYTES = 227 * 1024  # the most one block may use on sm_90
GLOBAL_ACCESS = ("ld.global", "st.global", "cp.async", "atom.global", "red.global")


def assert_waits_before_memory(ptx: str, name: str) -> None:
    """Under PDL a kernel may start before the previous one has finished: it must wait
    (griddepcontrol.wait) before it touches global memory, and it lets the next one start."""
    body = ptx[ptx.index(".entry"):]
    wait = body.find("griddepcontrol.wait")
    assert wait >= 0 and "griddepcontrol.launch_dependents" in body, f"{name}: no PDL prologue"
    first = min((i for i in (body.find(op) for op in GLOBAL_ACCESS) if i >= 0), default=len(body))
    assert wait < first, f"{name}: global memory accessed before griddepcontrol.wait"
