#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (and `llama-quantize`, and best effort `llama-perplexity`) from the llama.cpp sources vendored in the sdist of the
# installed llama-cpp-python, so the served model runs exactly the engine that the in-process
# gguf: source runs. Output: $LOGITDIFF_TOOLS/llama-server/<version>/bin/llama-server (+ a
# `current` symlink); LOGITDIFF_TOOLS defaults to ~/.cache/logitdiff/tools, outside the
# checkout, so a fresh clone on the same machine reuses the ~15-minute build. Idempotent: skips the build when that binary exists for that version.
#   GGML_NATIVE=OFF as for llama-cpp-python (scripts/setup.sh); no curl, no OpenSSL, no web UI.
#   JOBS (default 2) parallel compile jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TOOLS=${LOGITDIFF_TOOLS:-$HOME/.cache/logitdiff/tools}
PY=${PYTHON:-$ROOT/.venv/bin/python}
VER=$("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')
DEST="$TOOLS/llama-server/$VER"
BIN="$DEST/bin/llama-server"
QBIN="$DEST/bin/llama-quantize"  # llama.cpp's quantizer CLI, for `logitdiff quantize --imatrix`
# llama-perplexity: the --kl-divergence tool bench/perplexity_parity.py and the slow test of
# tests/test_text_workload.py compare with. Best effort: a failed build of it fails nothing.
PBIN="$DEST/bin/llama-perplexity"
if [ -x "$BIN" ] && [ -x "$QBIN" ] && "$BIN" --version >/dev/null 2>&1; then
  ln -sfn "$VER" "$TOOLS/llama-server/current"
  echo "llama-server $VER: $BIN (already built)"
  [ -x "$PBIN" ] || [ -n "${SKIP_PERPLEXITY:-}" ] || BUILD_PERPLEXITY_ONLY=1
  [ -n "${BUILD_PERPLEXITY_ONLY:-}" ] || exit 0
fi
WORK="$TOOLS/llama-server/src-$VER"
mkdir -p "$WORK"
SDIST=$(ls "$WORK"/llama_cpp_python-"$VER".tar.gz 2>/dev/null || true)
if [ -z "$SDIST" ]; then
  "$PY" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$VER" -d "$WORK" \
    || "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$WORK"
  SDIST="$WORK/llama_cpp_python-$VER.tar.gz"
fi
if [ ! -d "$WORK/llama_cpp_python-$VER/vendor/llama.cpp" ]; then
  tar -xzf "$SDIST" -C "$WORK"
fi
SRC="$WORK/llama_cpp_python-$VER/vendor/llama.cpp"
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DBUILD_SHARED_LIBS=OFF >"$WORK/cmake-configure.log" 2>&1 \
  || { tail -40 "$WORK/cmake-configure.log"; exit 1; }
if [ -n "${BUILD_PERPLEXITY_ONLY:-}" ]; then
  # only llama-perplexity is missing: build it alone (its libraries are rebuilt here, minutes)
  if cmake --build "$WORK/build" --target llama-perplexity -j "${JOBS:-2}" >"$WORK/cmake-build-perplexity.log" 2>&1; then
    mkdir -p "$DEST/bin"
    cp "$WORK/build/bin/llama-perplexity" "$PBIN.tmp$$" && mv "$PBIN.tmp$$" "$PBIN" && echo "llama-perplexity $VER: $PBIN"
  else
    tail -20 "$WORK/cmake-build-perplexity.log"; echo "llama-perplexity: build failed (best effort, skipped)"
  fi
  rm -rf "$WORK/build"
  exit 0
fi
cmake --build "$WORK/build" --target llama-server llama-quantize -j "${JOBS:-2}" >"$WORK/cmake-build.log" 2>&1 \
  || { tail -60 "$WORK/cmake-build.log"; exit 1; }
mkdir -p "$DEST/bin"
if cmake --build "$WORK/build" --target llama-perplexity -j "${JOBS:-2}" >"$WORK/cmake-build-perplexity.log" 2>&1; then
  cp "$WORK/build/bin/llama-perplexity" "$PBIN.tmp$$" && mv "$PBIN.tmp$$" "$PBIN"
else
  echo "llama-perplexity: build failed (best effort, skipped; see $WORK/cmake-build-perplexity.log)"
fi
cp "$WORK/build/bin/llama-server" "$BIN.tmp$$"
mv "$BIN.tmp$$" "$BIN"
cp "$WORK/build/bin/llama-quantize" "$QBIN.tmp$$"
mv "$QBIN.tmp$$" "$QBIN"
ln -sfn "$VER" "$TOOLS/llama-server/current"
"$BIN" --version 2>&1 | head -3 || true
echo "llama-server $VER: $BIN"
# keep the sdist (for rebuilds), drop the build tree
rm -rf "$WORK/build"
