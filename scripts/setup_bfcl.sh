#!/usr/bin/env bash
# Install the Berkeley Function Calling Leaderboard's package (bfcl-eval) into its own venv,
# $LOGITDIFF_TOOLS/bfcl-venv (default ~/.cache/logitdiff/tools, outside the checkout), for
# `--workload bfcl:CATEGORY[:N]`: its data and its own AST checker decide, called across the
# process boundary (logitdiff/workload/bfcl_bridge.py). Its own venv because it pins
# numpy==1.26.4 and its checker imports every provider SDK (constants.model_config).
# Idempotent: does nothing when that venv already imports this version.
#   * torch 2.13.0 (CPU) first, so sentence-transformers (a bfcl-eval requirement) keeps the CPU wheel.
#   * soundfile: qwen-agent (a bfcl-eval requirement, 0.0.34 here) imports it at the top of
#     qwen_agent.utils without declaring it, and the checker imports qwen_agent through its handlers.
# Took 37 min on this 2-core machine (torch 16 min, resolving and fetching bfcl-eval's ~260 dependencies 20 min).
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${BFCL_EVAL_VERSION:-2026.3.23}
VENV=${LOGITDIFF_TOOLS:-$HOME/.cache/logitdiff/tools}/bfcl-venv
PY=${PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VER" <<'PY' 2>/dev/null
import sys, importlib.metadata as md, importlib.util
sys.exit(0 if md.version("bfcl-eval") == sys.argv[1] and importlib.util.find_spec("soundfile") else 1)
PY
then
  echo "bfcl-eval $VER: $VENV (already installed)"
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet "bfcl-eval==$VER" soundfile
scratch=$(mktemp -d)  # BFCL makes result, score and lock folders in BFCL_PROJECT_ROOT on import
BFCL_PROJECT_ROOT=$scratch "$VENV/bin/python" - <<'PY'
from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker  # noqa: F401 (imports every handler)
import importlib.metadata as md
print("bfcl-eval", md.version("bfcl-eval"))
PY
rm -rf "$scratch"
