#!/usr/bin/env bash
# One device call (about 8-9 minutes): the GPU tests of every opt-in kernel variant not yet
# measured, then their A/B against the defaults in one process per length, every setting timed
# twice, alternated (bench/device_run.sh's tests and sweep stages). Summarise the result here with
#   python bench/ab_summary.py <files_at>/sweep.jsonl
# Variants (docs/notes/kernel_measurements.md v16-v18):
#   backward: every program as pieces of 1 or 3 query heads (atomic or TMA dK/dV adds), the dS
#             exchange without the release mbarrier or through a named barrier, dQ from registers;
#   forward:  persistent (one program per SM over a queue of items), and v15's owed tile-order A/B.
# PART=bwd or PART=fwd runs one half (e.g. when a call must be shorter); TESTS=0 skips the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
BWD_SETS="MAGI_GLUON_BWD_PIECES=1;MAGI_GLUON_BWD_PIECES=1,MAGI_GLUON_BWD_PIECE_ADD=tma;\
MAGI_GLUON_BWD_PIECES=3,MAGI_GLUON_BWD_PIECE_ADD=tma;MAGI_GLUON_BWD_DS_SYNC=implied;MAGI_GLUON_BWD_DS_SYNC=named;\
MAGI_GLUON_BWD_DQ_ADD=atomic"
FWD_SETS="MAGI_GLUON_FWD_PERSIST=0;MAGI_GLUON_FWD_PERSIST=1;MAGI_GLUON_FWD_ORDER=tile;\
MAGI_GLUON_FWD_PERSIST=1,MAGI_GLUON_FWD_ORDER=tile"
TEST_SELECTION="head_pieces or mixed_pieces or dq_atomics or ds_syncs or unsplit or persist"
PART=${PART:-all}
STAGES_FIRST="sweep"
[ "${TESTS:-1}" = 1 ] && STAGES_FIRST="tests sweep"
INSTALLED=0
if [ "$PART" != fwd ]; then
  TEST_WORKERS=${TEST_WORKERS:-4} EXTRA_TESTS=0 TEST_TIMEOUT=${TEST_TIMEOUT:-170} STAGES="$STAGES_FIRST" \
    TEST_K="$TEST_SELECTION" SWEEP_WARM=1 WARM_TIMEOUT=150 SWEEP_SEQLEN="16384 32768 8192" \
    SWEEP_MASKS="causal full varlen_causal" SWEEP_REP_MS=300 SWEEP_TIMEOUT=100 \
    MAGI_SWEEP_SETS="default;$BWD_SETS;default;$BWD_SETS" bash bench/device_run.sh
  INSTALLED=1 STAGES_FIRST="sweep"
fi
if [ "$PART" != bwd ]; then
  echo "=== forward A/B"
  SKIP_INSTALL=$INSTALLED TEST_WORKERS=${TEST_WORKERS:-4} EXTRA_TESTS=0 TEST_TIMEOUT=${TEST_TIMEOUT:-170} \
    STAGES="$STAGES_FIRST" TEST_K="persist" SWEEP_WARM=1 WARM_TIMEOUT=100 SWEEP_SEQLEN="16384 32768 8192" \
    SWEEP_MASKS="sliding_window varlen_causal varlen_block_causal causal full" SWEEP_REP_MS=250 SWEEP_TIMEOUT=70 \
    MAGI_SWEEP_SETS="$FWD_SETS;$FWD_SETS" bash bench/device_run.sh
fi
python3 bench/ab_summary.py "$OUT/sweep.jsonl" 2>/dev/null | awk '$NF != "x1.000"' | tail -n 90
