#!/usr/bin/env bash
# The GPU tests of every opt-in kernel variant not yet measured, then their A/B against the
# defaults in one process per length, every setting timed twice, in rounds of opposite order
# (bench/device_run.sh's tests and sweep stages). About 7-8 minutes in all, one device call
# (PART splits it in two: the backward half ~4-5 minutes, the forward half ~3).
# Summarise the result here with
#   python bench/ab_summary.py <files_at>/sweep.jsonl
# Still pending after v19 (docs/notes/kernel_measurements.md), each on the card it lands on:
#   backward: the per-launch pieces (default) against whole programs everywhere
#             (MAGI_GLUON_BWD_PIECES=0): measured on an H100 only;
#   forward:  persistent (one program per SM over a queue of items, the default since v19) and
#             v15's tile order: measured on an H100 in v22 (persistent x1.00-1.03 per mask, tile
#             order x0.96-1.02: kept off), both still unmeasured on an H200.
# Re-timed since v23: every earlier A/B timed its baseline first in each mask's block, right after
# the setup's idle gap, at an SM clock ~4 % above the rest (v23 notes: bench/gpu_clocks.py over
# the archived logs), which understated every variant. sweep_tiles.py now heats the card before
# a block and reverses every other round; the variants whose verdict could flip are timed again:
# the dS exchange without ds_empty / with a named barrier (v19: x0.99-1.02 raw, x1.01-1.04 per
# MHz), the reversed head walk (v19: x1.01-1.03, x1.02-1.10 per MHz) and the forward's tile
# order (v22: x0.96-1.02, x1.01-1.06 per MHz).
# PART=bwd or PART=fwd runs one half (PART=bwd runs the tests of every pending variant, forward
# ones too, so follow it with PART=fwd TESTS=0). TESTS=0 skips the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
BWD_SETS="MAGI_GLUON_BWD_PIECES=0;MAGI_GLUON_BWD_DS_SYNC=implied;MAGI_GLUON_BWD_DS_SYNC=named;\
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
