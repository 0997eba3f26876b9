#!/usr/bin/env bash
# Peak host memory (RSS) per rank of a data-parallel job against one
# process with the same global batch (docs/Distributed.md, "Memory"): a
# 27.7M-parameter Wan-style config (4 blocks, 8 heads of 64, FFN 4096;
# 332 MB of host state, 221 MB of it AdamW moments) at 5x32x32 on the cpu
# backend, 3 steps. Each rank holds 1/N of the masters and moments, so a
# rank should need about (N - 1)/N of 332 MB less than one process.
# Usage: benchmarks/dp_host_memory.sh [BUILD] (default build/).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
run=${1:-$root/build}/bin/megaslide-run
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$root/configs/tiny.json" "$tmp/mid.json" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
config.update(name="mid", num_layers=4, num_attention_heads=8,
              attention_head_dim=64, ffn_dim=4096, text_dim=512)
json.dump(config, open(sys.argv[2], "w"))
EOF
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(--model "$tmp/mid.json" --frames 5 --height 32 --width 32
  --backend cpu --no-progress --steps 3)
for ranks in 1 2 4; do
  if [ "$ranks" = 1 ]; then
    /usr/bin/time -f "peak %M KB" "$run" "${args[@]}" --grad-accum 4 \
      2>&1 >/dev/null | grep '^peak' | sed 's/^/1 process, --grad-accum 4: /'
  else
    mpirun -np "$ranks" --oversubscribe /usr/bin/time -f "peak %M KB" \
      "$run" "${args[@]}" --grad-accum $((4 / ranks)) 2>&1 >/dev/null |
      grep '^peak' | sed "s/^/$ranks ranks x --grad-accum $((4 / ranks)), a rank: /"
  fi
done
