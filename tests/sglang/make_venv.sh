#!/usr/bin/env bash
# Build the venv for the SGLang contract tests: the real sglang 0.5.23 wheel without its
# dependencies (CUDA-only at run time) and the light packages its imports need on a CPU, over the
# project venv's packages (tests/overlay_venv.sh: torch, transformers, eagle3_pipeline through a .pth
# file instead of a second torch install). Idempotent.
#
# usage: tests/sglang/make_venv.sh [VENV_DIR] [MAIN_VENV_DIR]
set -euo pipefail

root="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$root/.venv-sglang}"
main_venv="${2:-$root/.venv}"

# Pins: sglang's own pins where it has them (compressed-tensors, sentencepiece, apache-tvm-ffi),
# else the versions these tests were written against. triton is real (sglang.srt.utils.common
# imports it at module level); torchvision is not installable here (PyPI's wheel is CUDA-built),
# so tests/sglang/stubs/torchvision stands in for it at import time only.
packages=(
  sglang==0.5.23
  triton==3.9.0
  apache-tvm-ffi==0.1.11
  compressed-tensors==0.18.0
  sentencepiece==0.2.1
  gguf==0.19.0
  orjson==3.13.0
  pybase64==1.5.1
  msgspec==0.23.0
  pyzmq==27.3.0
  pillow==13.0.0
  requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3
  starlette==1.10.0
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1
  ipython==9.18.1 ipython_pygments_lexers==1.1.1 asttokens==3.0.2 executing==2.3.0 jedi==0.20.1
  parso==0.8.7 matplotlib-inline==0.2.2 prompt_toolkit==3.0.53 pure_eval==0.2.4 stack-data==0.6.3
  traitlets==5.16.1 wcwidth==0.9.4
  dill==0.4.1
  loguru==0.7.3
  einops==0.8.2
  openai==2.8.0 httpx==0.28.1 sniffio==1.3.1
  partial_json_parser==0.2.1.1.post7
)
exec "$root/tests/overlay_venv.sh" "$venv" "$main_venv" \
  'import sglang.srt.server_args, sglang.srt.model_executor.hook_manager, eagle3_pipeline' "${packages[@]}"
