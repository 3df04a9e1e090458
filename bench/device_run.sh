#!/usr/bin/env bash
# One device call: build the native extensions, run the GPU tests, the kernel benchmark of the
# default backend, then the v3 patch's tests and a short benchmark. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
for p in magi-solver magi-kernels magi-comm magi-attn; do
  python3 -m pip install -q --no-build-isolation --no-deps -e packages/$p > $OUT/install_$p.log 2>&1 || echo "install $p failed"
done
export PYTHONPATH=$PWD/packages/magi-solver/src:$PWD/packages/magi-attn/src
python3 -c "import magi_comm, magi_kernels" 2>/dev/null || { echo "native installs failed: pure-Python paths"; \
  export PYTHONPATH=$PYTHONPATH:$PWD/packages/magi-comm/src:$PWD/packages/magi-kernels/src; tail -5 $OUT/install_magi-comm.log; }
python3 -c "import magi_comm.native as n, magi_kernels.triton_backend as t; print('native comm', n.AVAILABLE, n.WITH_CUDA, n.REASON, '| kernels', t._native is not None)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -x -q tests/test_triton_gpu.py tests/test_native.py 2>&1 | tail -3
timeout 90 python3 -m pytest -x -q tests/test_ipc_gpu.py 2>&1 | tail -3
SUM='import sys,json
for l in sys.stdin:
    r=json.loads(l); f=lambda p:" ".join(f"{k.split(chr(95))[0]}:{r.get(k,0):.0f}" for k in (f"magi_{p}_tflops",f"flex_{p}_tflops",f"cudnn_{p}_tflops")); print(r["seqlen"],r["mask"],"fwd",f("fwd"),"| bwd",f("bwd"),"| meta_ms",round(r["magi_meta_ms"],3))'
[ -n "${SKIP_BENCH:-}" ] || timeout ${BENCH_TIMEOUT:-300} python3 bench/bench_kernels.py --seqlens ${SEQLENS:-8192 16384 32768} --out $OUT/bench_kernels_h200.json --plot $OUT/bench_kernels_h200.png 2>&1 | grep '^{' | python3 -c "$SUM"
if [ -n "${V3:-}" ]; then
  echo "=== v3 patch"
  patch -p1 < docs/notes/triton_v3_dq_kernel.patch > /dev/null && \
  timeout 120 python3 -m pytest -x -q tests/test_triton_gpu.py 2>&1 | tail -2 && \
  timeout 100 python3 bench/bench_kernels.py --no-peers --seqlens 16384 --masks full varlen_causal --out $OUT/v3.json 2>&1 | grep '^{' | python3 -c "$SUM"
fi
timeout 60 python3 bench/bench_ipc.py --world 2 --out $OUT/bench_ipc.json 2>&1 | tail -1
