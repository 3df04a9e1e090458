#!/usr/bin/env bash
# Device call: registers, local-memory spills and shared memory of every Triton kernel compiled by
# one bench run (ours and the peers' Inductor kernels), to compare kernels that differ in speed.
#   BWD_CFGS  extra magi-only runs, one per dK/dV config (MAGI_TRITON_BWD_CFG values)
#   SEQLENS, MASKS  the bench run with peers
# Writes $OUT/res_usage.txt (cuobjdump -res-usage per cubin) and $OUT/kernels.tgz (TTGIR of the
# attention kernels and the Inductor source of the Flex kernels).
set -uo pipefail
STAGES=none bash bench/device_run.sh  # installs the packages (native extensions)
export PYTHONPATH=$PWD/packages/magi-solver/src:$PWD/packages/magi-attn/src
export TRITON_CACHE_DIR=/tmp/res_tcache TORCHINDUCTOR_CACHE_DIR=/tmp/res_icache
rm -rf "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
for cfg in ${BWD_CFGS:-}; do
  echo "== MAGI_TRITON_BWD_CFG=$cfg"
  MAGI_TRITON_BWD_CFG=$cfg timeout 120 python3 bench/bench_kernels.py --seqlens ${SEQLENS:-16384} \
    --masks ${MASKS:-full} --no-peers --out /tmp/res_$cfg.json 2>>$OUT/res.err | grep '^{' | cut -c1-400
done
timeout ${BENCH_TIMEOUT:-300} python3 bench/bench_kernels.py --seqlens ${SEQLENS:-16384} --masks ${MASKS:-full} \
  --out $OUT/res_bench.json 2>>$OUT/res.err | grep '^{' | cut -c1-600
OBJDUMP=$(command -v cuobjdump || echo "$(python3 -c 'import triton,os;print(os.path.dirname(triton.__file__))')/backends/nvidia/bin/cuobjdump")
for f in $(find "$TRITON_CACHE_DIR" -name '*.cubin'); do
  echo "# $f"; "$OBJDUMP" -res-usage "$f" 2>&1 | grep -A1 "Function"
done > $OUT/res_usage.txt
grep -B1 -A1 -iE "bwd|backward|tem_fused" $OUT/res_usage.txt | grep -E "Function|REG" | head -40
tar czf $OUT/kernels.tgz $(find "$TRITON_CACHE_DIR" -name '*.ttgir' -o -name '*.source' | grep -iE "bwd|tem|fwd") \
  $(grep -rlE "flex_attention|tem_fused" "$TORCHINDUCTOR_CACHE_DIR" --include='*.py' 2>/dev/null | head -20) 2>/dev/null
ls -la $OUT
