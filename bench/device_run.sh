#!/usr/bin/env bash
# One device call: build the native extensions, then the stages named in STAGES (default: all)
#   tests  GPU correctness tests (Triton kernels, native kernels, CUDA IPC collectives; TEST_K,
#          TEST_WORKERS=n runs them in n pytest-xdist processes (compiles in parallel),
#          EXTRA_TESTS=0 skips the IPC run)
#   sweep  tile-config sweep of the Triton kernels (bench/sweep_tiles.py; SWEEP_SEQLEN may list several;
#          SWEEP_WARM=1 first compiles every MAGI_SWEEP_SETS entry in parallel processes, WARM_JOBS at
#          a time (default 6), so the timed sweep finds each kernel in Triton's cache)
#   bench  kernel benchmark with peers (bench/bench_kernels.py, SEQLENS, BENCH_MASKS, BENCH_TIMEOUT,
#          BENCH_ARGS: more of its flags, e.g. --no-triton-ab)
#   ipc    CUDA IPC GroupCast bandwidth (bench/bench_ipc.py)
#   ncu    Nsight Compute report of one Gluon backward launch (NCU_SEQLENS, NCU_MASKS), if ncu is there
#   ncu_fwd Nsight Compute report of one magi and one cuDNN forward launch (bench/fwd_profile.py; NCU_SEQLENS,
#          NCU_MASKS full/causal)
#   timing the backward timed through autograd and directly, short and long windows (bench/bwd_timing_check.py)
# Results and logs under $OUT (gpu_clocks.csv: SM clock/power/temperature through the call, joined
# with the bench's and the sweep's timing windows by bench/gpu_clocks.py at the end).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
STAGES=${STAGES:-tests sweep bench ipc}
has() { [[ " $STAGES " == *" $1 "* ]]; }
# (at most 8 files come back from the device: install logs stay in /tmp unless an install fails)
# (SKIP_INSTALL=1: a second run in the same call keeps the first one's installs)
[ "${SKIP_INSTALL:-0}" = 1 ] || for p in magi-solver magi-kernels magi-comm magi-attn; do
  python3 -m pip install -q --no-build-isolation --no-deps -e packages/$p > /tmp/install_$p.log 2>&1 \
    || { echo "install $p failed"; cp /tmp/install_$p.log $OUT/; }
done
export PYTHONPATH=$PWD/packages/magi-solver/src:$PWD/packages/magi-attn/src
python3 -c "import magi_comm, magi_kernels" 2>/dev/null || { echo "native installs failed: pure-Python paths"; \
  export PYTHONPATH=$PYTHONPATH:$PWD/packages/magi-comm/src:$PWD/packages/magi-kernels/src; tail -5 /tmp/install_magi-comm.log; }
python3 -c "import magi_comm.native as n, magi_kernels.triton_backend as t; print('native comm', n.AVAILABLE, n.WITH_CUDA, n.REASON, '| kernels', t._native is not None)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# the card in the bench's file names (h200, h100, ...): lent machines may be either, and their
# numbers are not interchangeable (H100: slower memory); the JSON's meta names the device as well
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h[0-9]{3}' | tr 'A-Z' 'a-z')
GPU_TAG=${GPU_TAG:-gpu}
# SM clock, power and temperature every 100 ms for the whole call: says whether a timing ran throttled
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 \
  >> $OUT/gpu_clocks.csv 2>/dev/null &
CLOCKS_PID=$!
if has tests; then
  # TEST_K selects a subset of the GPU tests (pytest -k expression)
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rf tests/kernels/test_triton_gpu.py tests/kernels/test_kernel_native.py tests/comm/test_native.py \
    ${TEST_WORKERS:+-n $TEST_WORKERS} ${TEST_K:+-k "$TEST_K"} > $OUT/tests.log 2>&1
  grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -12
  if [ "${EXTRA_TESTS:-1}" = 1 ]; then
    timeout 90 python3 -m pytest -q -rf tests/comm/test_ipc_gpu.py 2>&1 | tail -2
  fi
fi
if has sweep; then
  if [ "${SWEEP_WARM:-0}" = 1 ] && [ -n "${MAGI_SWEEP_SETS:-}" ]; then
    # one short process per distinct set, in parallel: Triton compiles on the CPU cores, the timed
    # sweep below then loads every variant from the cache instead of compiling inside its timeout
    # (at most WARM_JOBS at once: each process holds a CUDA context and a compiler's memory)
    T0=$SECONDS
    echo "$MAGI_SWEEP_SETS" | tr ';' '\n' | sort -u | grep . | WARM_TIMEOUT=${WARM_TIMEOUT:-240} \
      xargs -P ${WARM_JOBS:-6} -I{} sh -c 'MAGI_SWEEP_SETS="{}" timeout $WARM_TIMEOUT python3 bench/sweep_tiles.py \
        --seqlen 4096 --rep-ms 1 --masks causal > /dev/null 2>> /tmp/warm.err'
    echo "warm-up compiles: $((SECONDS - T0)) s"; grep -m3 -i error /tmp/warm.err
  fi
  # MAGI_SWEEP="VAR=a;b;a;b" with SWEEP_REP_MS=1000 is an A/B run
  for S in ${SWEEP_SEQLEN:-16384}; do
    timeout ${SWEEP_TIMEOUT:-200} python3 bench/sweep_tiles.py --seqlen $S --rep-ms ${SWEEP_REP_MS:-150} \
      --masks ${SWEEP_MASKS:-full varlen_causal} >> $OUT/sweep.jsonl 2>> $OUT/sweep.err
  done
  python3 -c "import json
for l in open('$OUT/sweep.jsonl'): r=json.loads(l); print(r['mask'][:9], r['var'][12:], r['cfg'], r['pass'], r.get('tflops', r.get('error','')[:60]))"
fi
SUM='import sys,json
for l in sys.stdin:
    r=json.loads(l); f=lambda p:" ".join(f"{k.split(chr(95))[0]}:{r.get(k,0):.0f}" for k in (f"magi_{p}_tflops",f"flex_{p}_tflops",f"cudnn_{p}_tflops")); print(r["seqlen"],r["mask"],"fwd",f("fwd"),"triton:%.0f"%r.get("magi_triton_fwd_tflops",0),"| bwd",f("bwd"),"triton:%.0f"%r.get("magi_triton_bwd_tflops",0),"| err",round(r.get("flex_vs_magi_maxerr",-1),3),round(r.get("flex_vs_magi_grad_maxerr",-1),3),"| meta build idle/busy ms %.2f/%.2f"%(r.get("magi_meta_build_ms",-1),r.get("magi_meta_build_busy_ms",-1)))'
if has bench; then
  timeout ${BENCH_TIMEOUT:-300} python3 bench/bench_kernels.py --seqlens ${SEQLENS:-8192 16384 32768} ${BENCH_MASKS:+--masks $BENCH_MASKS} ${BENCH_ARGS:-} \
    --out $OUT/bench_kernels_$GPU_TAG.json --plot $OUT/bench_kernels_$GPU_TAG.png 2>$OUT/bench.err | grep '^{' | python3 -c "$SUM"
fi
has timing && timeout ${TIMING_TIMEOUT:-150} python3 bench/bwd_timing_check.py --seqlen ${TIMING_SEQLEN:-16384} \
  > $OUT/bwd_timing.jsonl 2> $OUT/bwd_timing.err && cat $OUT/bwd_timing.jsonl
# the Nsight Compute binary for the ncu stages (empty if not installed)
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if has ncu; then
  # all reports go to one file (8 files come back at most)
  if [ -z "$NCU" ]; then echo "ncu: not installed"; else
    for S in ${NCU_SEQLENS:-16384 32768}; do for M in ${NCU_MASKS:-full}; do
      echo "=== ncu $M $S" | tee -a $OUT/ncu.txt
      timeout ${NCU_TIMEOUT:-120} $NCU -k regex:bwd_ws -c 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section LaunchStats python3 bench/bwd_timing_check.py --seqlen $S --masks $M --windows-ms 1 --rounds 1 \
        > /tmp/ncu_run.txt 2>&1
      cat /tmp/ncu_run.txt >> $OUT/ncu.txt
      grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|Issue Slots Busy" /tmp/ncu_run.txt | head -14
    done; done
  fi
fi
if has ncu_fwd; then
  if [ -z "$NCU" ]; then echo "ncu: not installed"; else
    for S in ${NCU_SEQLENS:-16384}; do for M in ${NCU_MASKS:-full}; do
      echo "=== ncu fwd $M $S" | tee -a $OUT/ncu_fwd.txt
      timeout ${NCU_TIMEOUT:-150} $NCU -k regex:"fwd_ws|fprop|sdpa|cudnn" -s 2 -c 4 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
        --section LaunchStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
        python3 bench/fwd_profile.py --seqlen $S --mask $M > /tmp/ncu_fwd_run.txt 2>&1
      cat /tmp/ncu_fwd_run.txt >> $OUT/ncu_fwd.txt
      grep -E "^  [a-z_]|Duration|SM Frequency|Compute \(SM\) Throughput|hmma_cycles|pipe_xu|inst_executed.sum|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Registers Per|Stall" /tmp/ncu_fwd_run.txt | head -40
    done; done
  fi
fi
has ipc && timeout 60 python3 bench/bench_ipc.py --world 2 --out $OUT/bench_ipc.json 2>&1 | tail -1
kill $CLOCKS_PID 2>/dev/null
# the clock of the whole call, and per timing: bench/gpu_clocks.py adds the SM clock each
# implementation (bench) or setting (sweep) ran under to their result files
CLOCK_ARGS=""
[ -f $OUT/bench_kernels_$GPU_TAG.json ] && CLOCK_ARGS="--bench $OUT/bench_kernels_$GPU_TAG.json"
[ -f $OUT/sweep.jsonl ] && CLOCK_ARGS="$CLOCK_ARGS --sweep $OUT/sweep.jsonl"
python3 bench/gpu_clocks.py $OUT/gpu_clocks.csv $CLOCK_ARGS
true
