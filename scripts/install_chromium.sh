#!/usr/bin/env bash
# Best-effort: install Chromium so tests/test_html_report.py can open report.html headless
# (console errors, every plot drawn, the matrix sorts). Those tests skip without it, so this
# script never fails setup: it exits 0 whatever happens.
set -u
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  echo "chromium: already installed ($(command -v chromium || command -v chromium-browser))"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium: no apt-get here; install Chromium by hand to run the browser tests" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "chromium: not root and no password-less sudo; skipping (browser tests will skip)" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get install -y chromium >/dev/null 2>&1 \
  || { $SUDO apt-get update >/dev/null 2>&1 && $SUDO apt-get install -y chromium >/dev/null 2>&1; }; then
  echo "chromium: installed ($(command -v chromium))"
else
  echo "chromium: apt-get install failed; skipping (browser tests will skip)" >&2
fi
exit 0
