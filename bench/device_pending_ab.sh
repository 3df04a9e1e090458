#!/usr/bin/env bash
# The GPU tests of every opt-in kernel variant not yet measured, then their A/B against the
# defaults in one process per length, every setting timed twice, in rounds of opposite order
# (bench/device_run.sh's tests and sweep stages). About 7-8 minutes in all, one device call
# (PART splits it in two: the backward half ~4-5 minutes, the forward half ~3).
# Summarise the result here with
#   python bench/ab_summary.py <files_at>/sweep.jsonl
# Measured on an H100 in v24 (balanced order, docs/notes/kernel_measurements.md): the dS
# exchange without ds_empty (`implied`, the default since: x1.00-1.03 per mask), the named
# barrier (x0.99-1.03, off), the reversed head walk (x0.98-1.02, off), whole programs instead of
# per-launch pieces (causal x0.81, off), the persistent forward (x1.01-1.05, on) and the
# forward's tile order (x0.96-1.02, off). Still pending: all of these on an H200; each set below
# is timed against the current defaults.
# PART=bwd or PART=fwd runs one half (PART=bwd runs the tests of every pending variant, forward
# ones too, so follow it with PART=fwd TESTS=0). TESTS=0 skips the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
BWD_SETS="MAGI_GLUON_BWD_PIECES=0;MAGI_GLUON_BWD_DS_SYNC=mbarrier;MAGI_GLUON_BWD_DS_SYNC=named;\
MAGI_GLUON_BWD_WALK=head_rev"
FWD_SETS="MAGI_GLUON_FWD_PERSIST=0;MAGI_GLUON_FWD_PERSIST=1;MAGI_GLUON_FWD_ORDER=tile;\
MAGI_GLUON_FWD_PERSIST=1,MAGI_GLUON_FWD_ORDER=tile"
TEST_SELECTION="auto_pieces or head_pieces or mixed_pieces or unsplit or persist or ds_syncs or walk"
PART=${PART:-all}
TESTS=${TESTS:-1}
INSTALLED=0

# one half of the call: its GPU tests (if TESTS=1; pytest -k $1), then the A/B of sets $2 on masks
# $3, each length timed for $4 ms per setting within $5 s; the second half keeps the first's installs
ab_half() {
  local stages="sweep"
  [ "$TESTS" = 1 ] && stages="tests sweep"
  SKIP_INSTALL=$INSTALLED TEST_WORKERS=${TEST_WORKERS:-4} EXTRA_TESTS=0 TEST_TIMEOUT=${TEST_TIMEOUT:-170} \
    STAGES="$stages" TEST_K="$1" SWEEP_WARM=1 WARM_TIMEOUT=150 SWEEP_SEQLEN="16384 32768 8192" \
    SWEEP_MASKS="$3" SWEEP_REP_MS=$4 SWEEP_TIMEOUT=$5 MAGI_SWEEP_SETS="$2;$2" bash bench/device_run.sh
  INSTALLED=1
}

if [ "$PART" != fwd ]; then
  ab_half "$TEST_SELECTION" "default;$BWD_SETS" "causal full varlen_causal varlen_full varlen_block_causal" 300 100
fi
if [ "$PART" != bwd ]; then
  echo "=== forward A/B"
  [ "$INSTALLED" = 1 ] && TESTS=0  # the backward half already ran every pending test
  ab_half "persist" "$FWD_SETS" "sliding_window varlen_causal varlen_block_causal causal full" 250 70
fi
python3 bench/ab_summary.py "$OUT/sweep.jsonl"  # says so when the sweep timed nothing
