#!/usr/bin/env bash
# Device call: dQ modes (split / atomic / tma) timed at 16k, dK/dV tiles for the TMA mode, then
# the dQ-mode GPU tests. Results under $OUT.
set -uo pipefail
export EXTRA_TESTS=0 SWEEP_SEQLEN=${SWEEP_SEQLEN:-16384}
SHOW='import json,sys
for l in open(sys.argv[1]): r=json.loads(l); print(r["mask"][:12], r["var"][12:], r["cfg"], r["pass"], r.get("tflops", r.get("error","")[:90]))'
STAGES=sweep SWEEP_MASKS="full varlen_causal sliding_window" MAGI_SWEEP="MAGI_TRITON_DQ=split;atomic;tma" \
  bash bench/device_run.sh
MAGI_TRITON_DQ=tma MAGI_SWEEP="MAGI_TRITON_BWD_CFG=${TMA_CFGS:-64,128,8,3;64,128,8,2;32,128,8,3;64,64,4,3;128,128,8,2}" \
  timeout ${SWEEP2_TIMEOUT:-200} python3 bench/sweep_tiles.py --seqlen $SWEEP_SEQLEN --masks full varlen_causal \
  >> $OUT/sweep_tma_cfg.jsonl 2>> $OUT/sweep.err
python3 -c "$SHOW" $OUT/sweep_tma_cfg.jsonl
tail -3 $OUT/sweep.err
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -rf -x tests/test_triton_gpu.py -k "${TEST_K:-dq_mode and not split}" \
  > $OUT/tests.log 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -12
