#!/usr/bin/env bash
# Builds .gg/whl: the cp312 manylinux wheels the GPU machine lacks (Python 3.12 there, 3.11 here), at the
# versions of this .venv (where the tests pass). Carry [".gg/whl"] and install them on the machine with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gg/whl/*.whl
# then PYTHONPATH=/tmp/site:$PWD (benchmarks/gpu/env.sh). TOOLS_DEMO_CALLS.md says why each is there.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.gg/whl}
PKGS="pydantic pydantic-core annotated-types typing-inspection typing-extensions anyio idna sniffio structlog
openai jiter httpx2 httpcore2 truststore h11 starlette distro annotated-doc opentelemetry-api uvicorn click
httptools orjson gguf platformdirs accelerate psutil matplotlib contourpy cycler fonttools kiwisolver pillow
pyparsing python-dateutil tzdata attrs msgpack"
pins=()
for p in $PKGS; do
  v=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")
  pins+=("$p==$v")
done
mkdir -p "$OUT"
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$OUT" "${pins[@]}"
ls "$OUT" | wc -l
du -sh "$OUT"
