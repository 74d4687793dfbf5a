#!/usr/bin/env bash
# Set up logitdiff in ./.venv on a fresh machine: CPU torch first (a bare `torch`
# requirement would pull a multi-GB CUDA build), then the package with every extra.
# llama-cpp-python is built from source with GGML_NATIVE=OFF: the native build's AMX
# weight repacking segfaults on quantized GGUFs on some x86 CPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" python -m pip install --quiet -e '.[all,test]'
bash scripts/install_chromium.sh || true  # best effort: headless browser for the report.html tests
# Served-model backends for the tests and `openai:` sources: llama.cpp's llama-server
# built from the same llama.cpp as llama-cpp-python, and vLLM (CPU) in its own venv. Both
# live in ~/.cache/logitdiff/tools and are reused when present. SKIP_SERVERS=1 skips them.
if [ "${SKIP_SERVERS:-0}" != "1" ]; then
  bash scripts/build_llama_server.sh
  bash scripts/setup_vllm.sh
fi
python -c "import logitdiff, torch, transformers, llama_cpp; print('logitdiff', logitdiff.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| llama_cpp', llama_cpp.__version__)"
