#!/usr/bin/env bash
# Device call: several tile sweeps in a row, one per line of $SWEEPS:
#   "<env assignments> | <MAGI_SWEEP value> | <masks>"
# e.g. "MAGI_TRITON_DQ=tma | MAGI_TRITON_BWD_CFG=64,128,8,3;64,128,8,2 | full varlen_causal". Rows go to $OUT/sweeps.jsonl
# with the fixed env of their line; a summary is printed.
set -uo pipefail
STAGES=none bash bench/device_run.sh  # installs the packages (native extensions)
export PYTHONPATH=$PWD/packages/magi-solver/src:$PWD/packages/magi-attn/src
while IFS='|' read -r fixed sweep masks; do
  [ -z "${sweep// }" ] && continue
  echo "== $fixed | $sweep | $masks"
  env $fixed MAGI_SWEEP="$(echo $sweep)" timeout ${SWEEP_TIMEOUT:-200} python3 bench/sweep_tiles.py \
    --seqlen ${SWEEP_SEQLEN:-16384} --masks $masks 2>> $OUT/sweep.err \
    | python3 -c "import json,sys
for l in sys.stdin:
    r=json.loads(l); r['fixed']='$fixed'.strip(); print(json.dumps(r), file=open('$OUT/sweeps.jsonl','a'))
    print(r['mask'][:12], r['var'][12:], r['cfg'], r['pass'], r.get('tflops', r.get('error','')[:90]))"
done <<< "$SWEEPS"
tail -3 $OUT/sweep.err
