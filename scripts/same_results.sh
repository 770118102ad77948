#!/usr/bin/env bash
# Bit-identity across a change: `jdp train` tiny and llama-tiny (2 layers, batch 8, 12 steps, eval and checkpoint
# every 6) on 1 device, 4 devices and 2 processes x 2 devices, from the jdp source at SRC; each run's per-step
# loss, eval_loss and grad_norm and its params_sha256 go to OUT/NAME.txt. Run it for two checkouts and `cmp` the
# files (issue 41: identical before and after the redesign). The 2-process workers import jdp from SRC too.
#   usage: SRC=/path/to/checkout bash scripts/same_results.sh OUT [PYTHON]
set -euo pipefail
OUT=$(realpath -m "$1"); PY=${2:-python3}; SRC=$(realpath "${SRC:-.}")
mkdir -p "$OUT"; RUNS=$(mktemp -d)
trap 'rm -rf "$RUNS"' EXIT
S=(train.steps=12 train.log_every=1 train.eval_every=6 train.ckpt_every=6 train.progress=false
   train.tensorboard=false model.n_layers=2 train.batch_size=8)
JDP=(-c "import sys; sys.path.insert(0, '$SRC'); from jdp.cli import main; sys.exit(main())")
summarize() {  # RUN_DIR OUT_FILE
  "$PY" - "$1" "$2" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
with open(sys.argv[2], "w") as f:
    for r in rows:
        f.write(json.dumps({k: r.get(k) for k in ("step", "loss", "eval_loss", "grad_norm")}) + "\n")
    f.write("sha " + json.load(open(sys.argv[1] + "/summary.json"))["params_sha256"] + "\n")
PY
}
cd "$SRC"
for cfg in tiny llama-tiny; do
  for n in 1 4; do
    XLA_FLAGS=--xla_force_host_platform_device_count=$n "$PY" "${JDP[@]}" train $cfg "${S[@]}" \
      train.run_dir="$RUNS/$cfg-$n" > "$OUT/$cfg-$n.log" 2>&1
    summarize "$RUNS/$cfg-$n" "$OUT/$cfg-$n.txt"
  done
  PYTHONPATH="$SRC" JAX_PLATFORMS=cpu "$PY" "${JDP[@]}" launch --nproc-per-node 2 --devices-per-proc 2 -- train $cfg "${S[@]}" \
    train.run_dir="$RUNS/$cfg-2p" > "$OUT/$cfg-2p.log" 2>&1
  summarize "$RUNS/$cfg-2p" "$OUT/$cfg-2p.txt"
done
echo "wrote $OUT/*.txt"
