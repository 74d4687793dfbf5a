#!/usr/bin/env bash
# Regenerate docs/report-screenshot.png (the README's picture) from a `logitdiff run` output:
#   RUN_OUT=logitdiff-out bash scripts/report_screenshot.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_OUT=${RUN_OUT:-logitdiff-out}
HTML=$(mktemp -d)/report.html
.venv/bin/logitdiff report "$RUN_OUT" --out "$HTML"
mkdir -p docs
PROFILE=$(mktemp -d)
timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync --hide-scrollbars \
  --user-data-dir="$PROFILE" --virtual-time-budget=5000 --window-size=1400,2000 \
  --screenshot="$PWD/docs/report-screenshot.png" "file://$HTML" 2>/dev/null
rm -rf "$PROFILE" "$(dirname "$HTML")"
ls -la docs/report-screenshot.png
