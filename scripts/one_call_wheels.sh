#!/usr/bin/env bash
# Packs every wheel a GPU check needs into .whl/one (~62 MB), small enough for one device call
# to carry: Ray's wheel without its Java jars, RLlib and source maps (none of which Serve
# imports), stored uncompressed and then xz-compressed, beside the rest of .whl/c2 and the
# GPU-test wheels of .whl/gpu. Needs .whl/c1, .whl/c2 (../shared/device/serve_wheels.sh) and
# .whl/gpu (scripts/gpu_wheels.sh). scripts/gpu_serve_check.sh installs from it.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl/one && mkdir -p .whl/one
ray_name=$(cat .whl/c2/ray.name)
cat .whl/c1/ray.part.* .whl/c2/ray.part.* > "/tmp/$ray_name"
python3 - "/tmp/$ray_name" ".whl/one/$ray_name" <<'EOF'
import sys, zipfile

def unused(name: str) -> bool:
    return name.startswith(("ray/jars/", "ray/rllib/")) or name.endswith(".map")

src, dst = sys.argv[1:]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
    for info in zin.infolist():
        if unused(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            kept = [line for line in data.decode().splitlines() if not unused(line.split(",")[0])]
            data = ("\n".join(kept) + "\n").encode()
        info.compress_type = zipfile.ZIP_STORED
        zout.writestr(info, data)
EOF
xz -6 -T0 ".whl/one/$ray_name"
for w in .whl/c2/*.whl; do
  case $(basename "$w") in py_spy-*) ;; *) cp "$w" .whl/one/ ;; esac
done
for w in .whl/gpu/*.whl; do
  case $(basename "$w") in apache_tvm_ffi-*|gguf-*|llguidance-*|peft-*|xgrammar-*) cp "$w" .whl/one/ ;; esac
done
rm -f "/tmp/$ray_name"
du -sh .whl/one
