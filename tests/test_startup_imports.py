"""What a server process imports before its engine starts: none of torch, transformers or
Triton for the modules Serve loads into the engine replica and the ingress (and the app's
build), so the engine replica starts the engine's child process without first spending
seconds on imports the child does again (docs/deploy.md, "Start-up"). Checked in a fresh
interpreter, which names the project line that imported a heavy package. The engine's
public names resolve lazily (engine/__init__.py); each one still imports."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from serve_helpers import ROOT

HEAVY = ("torch", "transformers", "triton", "xgrammar", "llguidance")

# The modules a Serve process imports before its constructor runs (cloudpickle imports a
# deployment's class by its module): the app's build, the engine replica, the ingress; and
# the engine-side modules the replica's process needs to start the child.
SERVER_MODULES = ("deployments.app", "deployments.engine_replica", "deployments.ingress",
                  "deployments.colocated", "engine.runtime.process_engine",
                  "engine.runtime.engine_process_main")
# The engine names those modules import at their top.
LIGHT_NAMES = ("EngineConfig", "SamplingParams", "QueueFullError", "QueueTimeoutError",
               "StepReport", "WireDelta", "WireBatch", "StreamDelta", "wire_of",
               "validate_request", "Tokenizer", "ChatPrompt", "IncrementalDetokenizer",
               "ensure_demo_model", "freeze_after_start", "process_age_s", "ExportedPrefix",
               "EngineClient")

# Records, for each heavy package imported, the project line whose import brought it in.
WATCH = textwrap.dedent(f"""
    import json, sys, traceback
    HEAVY = {HEAVY!r}
    ROOT = {str(ROOT)!r}
    found = {{}}

    class Watch:
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            if top in HEAVY and top not in found:
                ours = [f"{{f.filename[len(ROOT) + 1:]}}:{{f.lineno}}"
                        for f in traceback.extract_stack() if f.filename.startswith(ROOT)]
                found[top] = ours[-1] if ours else "?"
            return None

    sys.meta_path.insert(0, Watch())
""")


def run_python(code: str) -> dict[str, str]:
    """Run `code` after WATCH in a fresh interpreter: {heavy package: who imported it}."""
    script = WATCH + code + "\nprint(json.dumps(found))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_server_modules_import_no_torch():
    imports = "\n".join(f"import {m}" for m in SERVER_MODULES)
    names = f"from engine import {', '.join(LIGHT_NAMES)}"
    assert run_python(f"{imports}\n{names}\n") == {}


def test_every_public_name_resolves():
    """Each name of `engine.__all__` loads its module on first use (the engine brings torch);
    an unknown name is an AttributeError."""
    found = run_python(textwrap.dedent("""
        import engine
        missing = [n for n in engine.__all__ if getattr(engine, n, None) is None]
        assert not missing, missing
        assert set(engine.__all__) <= set(dir(engine))
        try:
            engine.NoSuchName
        except AttributeError as e:
            assert "NoSuchName" in str(e)
        else:
            raise AssertionError("no AttributeError")
    """))
    assert "torch" in found
