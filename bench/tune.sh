#!/usr/bin/env bash
# Tile-config sweep of the Triton backend (magi only, no peers); prints one JSON line per run.
set -u
for f in "128,64,8,3" "128,128,8,3" "128,64,4,3" "64,64,4,3"; do
  for b in "64,64,8,2" "32,128,8,2" "64,128,8,2" "32,64,4,3"; do
    echo "== fwd=$f bwd=$b"
    MAGI_TRITON_FWD_CFG=$f MAGI_TRITON_BWD_CFG=$b timeout 120 python3 bench/bench_kernels.py --no-peers \
      --seqlens 16384 --masks full varlen_causal --out /tmp/t.json 2>&1 | grep '^{' | cut -c1-400
  done
done
