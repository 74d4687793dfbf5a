#!/usr/bin/env bash
# The GPU path of issue 16, in one short run: at V = 248,320 (a random Llama, hidden 128,
# 2 layers, on the bundled tokenizer widened to 248,320 tokens, built offline) capture a
# bf16 reference and a float16 candidate with transformers on the GPU, compare them with
# the metrics on the GPU, compare the same stored rows again on the CPU and check that both
# give the same numbers; score one item's candidate rows on the CPU too and print how far
# the GPU rows are from them. Prints positions/s of every step.
#
#
# Then (issue 24) capture's positions/s against the model's own forward on the same device,
# for a hidden-128 and a hidden-2,048 model at the same V (bench/capture_bench.py --wide:
# capture_candidate --store full and --store hidden, the bare forward + bf16 copy to the host,
# the forward alone, and the read rate of the hidden-state run), RATE_TOKENS x RATE_ITEMS
# positions, RATE_REPEATS interleaved rounds.
#
#   bench/gpu_check.sh                 # needs torch with CUDA and a visible device
#   DEVICE=cpu bench/gpu_check.sh      # (or --cpu) every step on the CPU, at small sizes
#                                      # unless set: tests the script end to end (~2 min)
#
# Environment: TOKENS (output length, default 2048; cpu 64), ITEMS (default 4; cpu 2), VOCAB
# (default 248320; cpu 8192), HIDDENS (default "128 2048"; cpu "64 256"), RATE_TOKENS
# (default 2048; cpu 64), RATE_ITEMS (default 4; cpu 2), RATE_REPEATS (default 3; cpu 1),
# STORE_VOCAB, STORE_HIDDEN, STORE_ITEMS, STORE_TOKENS, STORE_ROUNDS (the reference-store compare: default
# 262144, 640, 8, 64, 5; cpu 8192, 256, 2, 16, 1), WORK (default a temp dir), PYTHON (default: python).
# Exit status 0 only when every check passed.
set -euo pipefail

DEVICE=${DEVICE:-cuda}
if [ "${1:-}" = "--cpu" ]; then DEVICE=cpu; fi
if [ "$DEVICE" = cpu ]; then small=1; else small=0; fi
pick() { if [ "$small" = 1 ]; then echo "$2"; else echo "$1"; fi; }
TOKENS=${TOKENS:-$(pick 2048 64)}
ITEMS=${ITEMS:-$(pick 4 2)}
VOCAB=${VOCAB:-$(pick 248320 8192)}
HIDDENS=${HIDDENS:-$(pick "128 2048" "64 256")}
RATE_TOKENS=${RATE_TOKENS:-$(pick 2048 64)}
RATE_ITEMS=${RATE_ITEMS:-$(pick 4 2)}
RATE_REPEATS=${RATE_REPEATS:-$(pick 3 1)}
STORE_VOCAB=${STORE_VOCAB:-$(pick 262144 8192)}
STORE_HIDDEN=${STORE_HIDDEN:-$(pick 640 256)}
STORE_ITEMS=${STORE_ITEMS:-$(pick 8 2)}
STORE_TOKENS=${STORE_TOKENS:-$(pick 64 16)}
STORE_ROUNDS=${STORE_ROUNDS:-$(pick 5 1)}
PYTHON=${PYTHON:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$(mktemp -d /tmp/logitdiff-gpu-check.XXXXXX)}
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
LD() { "$PYTHON" -m logitdiff.cli "$@"; }

if [ "$DEVICE" = cuda ]; then
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch sees no CUDA device (use --cpu to test the script)')"
  "$PYTHON" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
fi
echo "work dir: $WORK  device: $DEVICE  tokens: $TOKENS  items: $ITEMS  vocab: $VOCAB"

M="$WORK/model"
if [ ! -f "$M/config.json" ]; then
  "$PYTHON" -c "from _models import make_wide_llama; make_wide_llama('$M', vocab_size=$VOCAB)"
fi
"$PYTHON" - "$WORK/w.jsonl" "$ITEMS" <<'EOF'
import json, sys
with open(sys.argv[1], "w") as f:
    for k in range(int(sys.argv[2])):
        f.write(json.dumps({"id": f"item{k}", "prompt": f"Item {k}: def fibonacci(n):\n    "}) + "\n")
EOF

t() {  # t NAME POSITIONS CMD...: run, print wall time and positions/s
  local name=$1 n=$2; shift 2
  local t0 t1; t0=$(date +%s.%N)
  "$@" >"$WORK/$name.log" 2>&1 || { echo "FAILED: $name"; tail -20 "$WORK/$name.log"; exit 1; }
  t1=$(date +%s.%N)
  "$PYTHON" -c "w=$t1-$t0; print(f'{\"$name\":<28} {w:8.2f} s  {$n/w:10.1f} positions/s')"
}

N=$((TOKENS * ITEMS))
t "capture reference (bf16)" $N LD capture "hf:$M,device=$DEVICE,batch=$ITEMS" --workload "$WORK/w.jsonl" \
  --max-tokens "$TOKENS" --out "$WORK/ref" --overwrite
t "capture candidate (f16)" $N LD capture "hf:$M,dtype=float16,device=$DEVICE,batch=$ITEMS" --reference "$WORK/ref" \
  --out "$WORK/cand" --overwrite
t "compare on $DEVICE" $N LD compare "$WORK/ref" "$WORK/cand" --out "$WORK/report-dev" --device "$DEVICE" --bootstrap 100 --no-rows
t "compare on cpu (same rows)" $N LD compare "$WORK/ref" "$WORK/cand" --out "$WORK/report-cpu" --device cpu --bootstrap 100 --no-rows
t "candidate item0 on cpu" $TOKENS LD capture "hf:$M,dtype=float16,device=cpu,batch=1" --reference "$WORK/ref" \
  --shard "0/$ITEMS" --out "$WORK/cand-cpu" --overwrite

"$PYTHON" - "$WORK" <<'EOF'
import sys
import numpy as np
import pyarrow.parquet as pq
from logitdiff.numerics import metrics as M
from logitdiff.store import RunReader

work = sys.argv[1]
dev = pq.read_table(f"{work}/report-dev/tokens.parquet").to_pandas()
cpu = pq.read_table(f"{work}/report-cpu/tokens.parquet").to_pandas()
ok = True
# Same stored rows, float64 metrics on two devices: each sum of V = 248,320 terms of size
# <= 1 differs by reduction order only, <= V * 2^-53 ~ 2.8e-11; a few sums per metric: 1e-9.
for col in ("kl_nats", "kl_rev_nats", "jsd_nats", "nll_ref", "nll_cand"):
    d = float(np.nanmax(np.abs(dev[col].to_numpy() - cpu[col].to_numpy())))
    good = d <= 1e-9
    ok &= good
    print(f"{col:<12} max |device - cpu| = {d:.3g}  {'ok' if good else 'FAIL (> 1e-9)'}")
for col in ("top1_ref", "top1_cand"):
    same = bool((dev[col].to_numpy() == cpu[col].to_numpy()).all())
    ok &= same
    print(f"{col:<12} identical: {same}")
print(f"mean KL(ref || cand) = {dev['kl_nats'].mean():.6g} nats over {len(dev)} positions")
# The candidate's rows from the device vs from the CPU for item 0: another kernel, other
# rounding; reported (it is drift between engines, not an error of the tool).
a, b = RunReader(f"{work}/cand"), RunReader(f"{work}/cand-cpu")
ia = next(it for it in a.items() if it.id == "item0")
za, zb = a.logits(ia), b.logits(b.items()[0])
m = M.full_vocab(za, zb, k=10)
print(f"candidate item0, {len(za)} rows: {'GPU' if 'cuda' in str(a.manifest['source']) else 'device'} vs CPU "
      f"mean KL {m['kl_nats'].mean():.3g} nats, max {m['kl_nats'].max():.3g}, top-1 agreement {m['top1_match'].mean():.4f}")
sys.exit(0 if ok else 1)
EOF

for H in $HIDDENS; do
  echo "--- capture vs forward, hidden $H, V = $VOCAB, $DEVICE"
  "$PYTHON" "$ROOT/bench/capture_bench.py" --wide "$WORK/rate" --device "$DEVICE" --hidden "$H" --vocab "$VOCAB" \
    --items "$RATE_ITEMS" --tokens "$RATE_TOKENS" --batch "$RATE_ITEMS" --repeats "$RATE_REPEATS" --hidden-store --no-fixed
done
# Issue 28: a compare against the hidden reference (decoded on $DEVICE: V x H multiply-adds a
# position) against the same compare against the full reference, at Gemma 3 270M's shape
# (V = 262,144, H = 640; on a 2-core CPU the decode alone holds SmolLM2's H = 576 above the
# issue's 1.5x, bench/RESULTS.md), with the compact reference in the same rounds.
echo "--- compare against full, hidden and compact references, V = $STORE_VOCAB, H = $STORE_HIDDEN, on $DEVICE"
"$PYTHON" "$ROOT/bench/store_bench.py" real "$WORK/stores" --wide --vocab "$STORE_VOCAB" --hidden-size "$STORE_HIDDEN" \
  --items "$STORE_ITEMS" --max-tokens "$STORE_TOKENS" --rounds "$STORE_ROUNDS" --skip-figures --device "$DEVICE"
echo "gpu_check: all checks passed ($DEVICE)"
