"""Run SGLang's own `python -m sglang.bench_serving` unchanged, beside a CPU-only torch.

    python scripts/sglang_bench_serving.py --backend sglang --base-url http://127.0.0.1:8000 \
        --dataset-name random-ids --num-prompts 32 --random-input-len 64 --random-output-len 32

Every argument goes to SGLang's `cli_main` as is. The one thing this wrapper adds: importing
`sglang.bench_serving` imports `sglang.srt.configs`, whose InternVL config module runs
`import torchvision.transforms` at module level. There is no CPU torchvision on PyPI (its
wheels link libc10_cuda.so), and the text benchmark never touches an image transform. So
when torchvision cannot be imported, `torchvision` resolves to a placeholder package that
imports fine and raises on any use: if the benchmark did call it, the run would fail loudly.
transformers is asked first whether torchvision is available (it is not, and the answer is
cached), so it does not take the placeholder for a real install.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Unusable(types.ModuleType):
    """A module (or attribute of one) that exists for `import` and fails when used."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unusable(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__} was called, but torchvision is not installed "
                           "(no CPU build exists); this benchmark path should not need it")


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Unusable(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def _torchvision_importable() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # missing, or a CUDA build that cannot load beside CPU torch
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        return False
    return True


def main() -> None:
    if not _torchvision_importable():
        from transformers.utils import import_utils
        import_utils.is_torchvision_available()  # cache transformers' (true) "no" first
        sys.meta_path.insert(0, _TorchvisionPlaceholder())
    from sglang.benchmark.serving import cli_main
    sys.argv[0] = "sglang.bench_serving"
    cli_main()


if __name__ == "__main__":
    main()
