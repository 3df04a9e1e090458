"""``magi-attn`` command line: ``run`` (distributed demo job), ``plan`` (solver report/plot),
``simulate`` (simulated scaling at 8-1024 GPUs), ``env``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


logger = logging.getLogger("magi_attn.cli")


def _run_worker(env, args: argparse.Namespace, use_cuda: bool) -> dict | None:
    """One rank of ``magi-attn run``; rank 0 returns the report."""
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from magi_kernels import flex_flash_attn_func
    from magi_solver import slice_ranges

    from . import DispatchConfig, DistAttnConfig, OverlapConfig, calc_attn, dispatch, magi_attn_flex_key, undispatch
    from .launch import init_worker
    from .masks import make_mask

    config = DistAttnConfig(DispatchConfig(chunk_size=args.chunk_size), OverlapConfig(degree=args.degree),
                            kernel_backend=args.backend, comm_backend=args.comm, ranks_per_node=args.ranks_per_node,
                            comm_timeout_s=args.timeout)
    device = init_worker(env, use_cuda, config.comm_timeout_s)
    rank, world = env.rank, env.world_size
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[args.dtype]
    slices = make_mask(args.mask, args.seqlen, window=args.window, block=args.block, seed=args.seed)
    t0 = time.perf_counter()
    key = magi_attn_flex_key([s.q_range for s in slices], [s.k_range for s in slices], [s.mask_type for s in slices],
                             args.seqlen, args.seqlen, args.heads_q, args.heads_kv, args.head_dim, dist.group.WORLD, config)
    plan_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(args.seqlen, h, args.head_dim, generator=gen).to(device, dtype)
               for h in (args.heads_q, args.heads_kv, args.heads_kv))
    ql, kl, vl = (dispatch(t, key).detach().requires_grad_() for t in (q, k, v))
    times = []
    for _ in tqdm(range(args.iters), desc="fwd+bwd", disable=rank != 0, file=sys.stderr):
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        out, _ = calc_attn(ql, kl, vl, key)
        out.float().square().sum().backward()
        if use_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        ql.grad = kl.grad = vl.grad = None
    with torch.no_grad():
        out, _ = calc_attn(ql, kl, vl, key)
    full_out = undispatch(out, key)
    if rank != 0:
        return None
    ref, _ = flex_flash_attn_func(q.double(), k.double(), v.double(), *slice_ranges(slices), backend="torch")
    err = (full_out.double() - ref).abs().max().item()
    tol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    area = sum(s.area for s in slices)
    med = sorted(times)[len(times) // 2]
    flops = 4 * area * args.heads_q * args.head_dim * 3.5  # fwd + bwd (2.5x)
    return {
        "backend": "nccl" if use_cuda else "gloo", "launched": env.launched, "cp": world, "mask": args.mask,
        "seqlen": args.seqlen, "slices": len(slices), "dtype": args.dtype, "plan_s": round(plan_s, 4),
        **key.runtime.plan.summary(), "median_fwd_bwd_s": round(med, 4),
        "tflops_per_rank": round(flops / med / world / 1e12, 6),
        "max_abs_err_vs_fp64": err, "tolerance": tol, "ok": err <= tol,
    }


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    from .launch import exit_worker, launched_env, run_workers

    env = launched_env()
    if env is not None and args.cp is not None and args.cp != env.world_size:
        raise ValueError(f"--cp {args.cp} disagrees with the launcher's WORLD_SIZE={env.world_size}; "
                         "leave --cp out under torchrun (the launcher sets the number of ranks)")
    nprocs = env.world_size if env is not None else (args.cp or 4)
    local = env.local_world_size if env is not None else nprocs
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda and torch.cuda.device_count() < local:
        logger.warning("only %d GPUs for %d ranks on this host: running on CPU processes with gloo",
                       torch.cuda.device_count(), local)
        use_cuda = False
    report = run_workers(_run_worker, nprocs, args, use_cuda)
    code = 0
    if report is not None:  # rank 0 (or the spawning process)
        print(json.dumps(report, indent=2))
        if not report["ok"]:
            print(f"magi-attn run: error: distributed result differs from the reference by "
                  f"{report['max_abs_err_vs_fp64']} > {report['tolerance']}", file=sys.stderr)
            code = 1
    if env is not None:  # a launched rank: leave without the teardown gloo's threads can abort
        exit_worker(code)
    return code


def cmd_plan(args: argparse.Namespace) -> int:
    from magi_solver import DispatchConfig, DistAttnPlan, OverlapConfig

    from .masks import make_mask

    t0 = time.perf_counter()
    slices = make_mask(args.mask, args.seqlen, window=args.window, block=args.block, seed=args.seed)
    cp = args.cp or 4
    plan = DistAttnPlan(slices, args.seqlen, cp, num_heads_q=args.heads_q, num_heads_kv=args.heads_kv,
                        head_dim=args.head_dim, dispatch_config=DispatchConfig(chunk_size=args.chunk_size),
                        overlap_config=OverlapConfig(degree=args.degree))
    casts = [[plan.cast_plan(s, r) for s in range(plan.num_stages)] for r in range(cp)]
    plan.calc_plan(0)
    summary = plan.summary()
    if args.ranks_per_node:
        from magi_comm import NodeTopology, inter_node_rows

        topo = NodeTopology(cp, args.ranks_per_node)
        for name, dedup in (("flat", False), ("two_hop", True)):
            summary[f"inter_node_kv_rows_{name}"] = sum(
                inter_node_rows(topo, r, c.input_split_sizes, c.dst_indices, dedup) for r in range(cp) for c in casts[r])
    summary["plan_s_all_ranks"] = round(time.perf_counter() - t0, 4)
    summary["slices"] = len(slices)
    if not args.verbose:  # per-rank lists; the balance (max/mean) and padding stay in the report
        for per_rank in ("shard_seqlens", "rank_areas", "remote_kv_rows"):
            summary.pop(per_rank)
    print(json.dumps(summary, indent=2))
    if args.plot:
        from .plot import plot_dispatch

        plot_dispatch(plan, args.plot, title=f"{args.mask}, {args.seqlen} tokens, cp={cp}")
        logger.warning("wrote %s", args.plot)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from tqdm import tqdm

    from .config import DistAttnConfig, OverlapConfig
    from .simulate import Case, KernelCostModel, LinkModel, Shape, Simulator, degree_check, format_table, plot, sweep

    links = LinkModel(args.ranks_per_node or 8, args.nvlink_gbps * 1e9, args.ib_gbps * 1e9)
    sim = Simulator(KernelCostModel(args.device), links, Shape(args.heads_q, args.heads_kv, args.head_dim),
                    DistAttnConfig(overlap=OverlapConfig(degree=None if args.degree == "auto" else int(args.degree)),
                                   comm_backend=args.comm))
    cases = [Case(m, t, cp) for m in args.masks for t in args.tokens_per_gpu for cp in args.cp]

    def bar(items, desc):
        return tqdm(items, desc=desc, file=sys.stderr, disable=args.quiet)

    t0 = time.perf_counter()
    rows = sweep(sim, cases, args.methods, lambda it: bar(list(it), "simulate"), per_rank=args.per_rank)
    report = {
        "SIMULATED": True,
        "note": ("Simulated, not measured: per-stage kernel times from a cost model fitted to single-GPU kernel "
                 "measurements, transfers from a link model; see README 'Simulated scaling'."),
        "cost_model": sim.cost.describe(), "links": asdict(links), "shape": asdict(sim.shape),
        "magi_overlap_degree": args.degree, "magi_comm_backend": args.comm, "rows": rows,
    }
    if args.check_degrees:
        report["degree_check"] = degree_check(sim, cases, lambda it: bar(list(it), "degrees"))
    report["simulate_s"] = round(time.perf_counter() - t0, 2)
    print(format_table(rows), file=sys.stderr)
    print(json.dumps(report, indent=2))
    if args.plot:
        plot(rows, args.plot, f"{sim.cost.meta['device']} kernels, hq={args.heads_q} hk={args.heads_kv} "
                              f"d={args.head_dim}, {links.ranks_per_node} GPUs/node")
        logger.warning("wrote %s", args.plot)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    import magi_comm
    import magi_kernels
    import magi_solver

    from . import __version__

    info = {
        "magi_attn": __version__, "magi_solver": magi_solver.__version__, "magi_kernels": magi_kernels.__version__,
        "magi_comm": magi_comm.__version__, "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
        "triton_backend": magi_kernels.triton_available(),
        # the kernels' process default: the measured settings and any MAGI_TRITON_* / MAGI_GLUON_* override
        "kernel_config": magi_kernels.default_kernel_config().describe(),
        # what magi-comm's native extension was built with, and whether it runs on this GPU
        "comm_native": magi_comm.native_build_info(),
    }
    if info["comm_native"]["with_cuda"] and torch.cuda.is_available():
        info["comm_native"] = magi_comm.native_build_info(torch.cuda.current_device())
    print(json.dumps(info, indent=2))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _int_list(lo: int, hi: int):
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
        if not values or any(not lo <= v <= hi for v in values):
            raise argparse.ArgumentTypeError(f"every value must be in [{lo}, {hi}], got {text!r}")
        return values
    return parse


def _choice_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(choices)}")
        return values
    return parse


def _degree(text: str) -> str:
    if text == "auto":
        return text
    try:
        if int(text) >= 0:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text!r}")


def _simulate_parser(sub) -> None:
    from .masks import MASKS
    from .simulate import DEVICES, METHODS

    p = sub.add_parser("simulate", help="SIMULATED per-GPU throughput of magi, ring, Ulysses and USP at cp 8-1024 "
                                        "(kernel cost model + link model; no GPU needed)")
    p.add_argument("--cp", type=_int_list(2, 1024), default=[8, 16, 32, 64],
                   help="comma-separated CP sizes (2..1024; default 8,16,32,64; cp 1024 takes minutes)")
    p.add_argument("--tokens-per-gpu", type=_int_list(128, 1 << 20), default=[8192],
                   help="comma-separated tokens per GPU (default 8192; e.g. 8192,16384,32768)")
    p.add_argument("--masks", type=_choice_list(MASKS), default=["varlen_causal"],
                   help="comma-separated masks of magi_attn.masks (default varlen_causal)")
    p.add_argument("--methods", type=_choice_list(METHODS), default=list(METHODS))
    p.add_argument("--device", choices=DEVICES, default="H100", help="whose kernel measurements price the kernels")
    p.add_argument("--heads-q", type=_positive_int, default=64)
    p.add_argument("--heads-kv", type=_positive_int, default=8)
    p.add_argument("--head-dim", type=_positive_int, default=128, help="the cost model knows 128 only")
    p.add_argument("--degree", type=_degree, default="auto", help="magi's overlap degree: auto (None) or an int")
    p.add_argument("--comm", choices=("a2a", "hier"), default="a2a",
                   help="magi's GroupCast/GroupReduce backend (hier: one inter-node copy per destination node)")
    p.add_argument("--ranks-per-node", type=_positive_int, default=8)
    p.add_argument("--nvlink-gbps", type=_positive_float, default=360.0, help="effective NVLink GB/s per direction")
    p.add_argument("--ib-gbps", type=_positive_float, default=40.0, help="effective InfiniBand GB/s per GPU")
    p.add_argument("--check-degrees", action="store_true",
                   help="also compare magi's automatic degree with every fixed degree 1..8")
    p.add_argument("--per-rank", action="store_true",
                   help="every rank's end, compute, transfer, exposed transfer and idle (ms), not just the slowest")
    p.add_argument("--plot", default=None, help="write a PNG of TFLOP/s per GPU against cp (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _common(p: argparse.ArgumentParser) -> None:
    from .masks import MASKS

    p.add_argument("--mask", choices=MASKS, default="varlen_causal")
    p.add_argument("--seqlen", type=_positive_int, default=8192)
    p.add_argument("--cp", type=_positive_int, default=None,
                   help="context-parallel ranks (default 4; under torchrun the launcher's WORLD_SIZE)")
    p.add_argument("--heads-q", type=_positive_int, default=8)
    p.add_argument("--heads-kv", type=_positive_int, default=2)
    p.add_argument("--head-dim", type=_positive_int, default=64)
    p.add_argument("--chunk-size", type=_positive_int, default=None)
    p.add_argument("--degree", type=_non_negative_int, default=2, help="overlap stages (0 = no overlap)")
    p.add_argument("--window", type=_positive_int, default=1024)
    p.add_argument("--block", type=_positive_int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-per-node", type=_positive_int, default=None,
                   help="ranks per node: run uses it with --comm hier; plan reports inter-node KV rows")


def _one_line(error: BaseException) -> str:
    """The last line of an error; a spawned worker's error arrives as its whole traceback."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="magi-attn", description=__doc__)
    parser.add_argument("--version", action="version", version=f"magi-attn {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="logging level of magi's loggers (stderr)")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="distributed attention fwd+bwd over CP processes, checked against fp64")
    _common(run)
    run.add_argument("--iters", type=_positive_int, default=3)
    run.add_argument("--dtype", choices=("fp32", "bf16", "fp64"), default="fp32")
    run.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto")
    run.add_argument("--cpu", action="store_true", help="force CPU processes with gloo")
    run.add_argument("--comm", choices=("a2a", "ipc", "hier"), default="a2a",
                     help="GroupCast/GroupReduce backend (hier: node-aware two hops, see --ranks-per-node)")
    run.add_argument("--timeout", type=_positive_float, default=None,
                     help="seconds a rank waits for its peers in a collective before it fails (default 300)")
    plan = sub.add_parser("plan", help="solve a mask and print the plan (optionally plot the dispatch)")
    _common(plan)
    plan.add_argument("--plot", default=None, help="write a PNG of mask and dispatch")
    plan.add_argument("--verbose", action="store_true")
    _simulate_parser(sub)
    sub.add_parser("env", help="versions and available backends")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: the JSON report alone goes to stdout; progress, logs and errors go to stderr.
    An error is one line (exit 1) unless ``--debug`` asks for its traceback."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.cmd is None:
        args = parser.parse_args([*argv, "run"])
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.cmd == "run" and args.timeout is None:
        from magi_comm import DEFAULT_TIMEOUT_S

        args.timeout = DEFAULT_TIMEOUT_S
    try:
        return {"run": cmd_run, "plan": cmd_plan, "simulate": cmd_simulate, "env": cmd_env}[args.cmd](args)
    except Exception as e:  # noqa: BLE001 - a CLI reports, --debug shows the traceback
        if args.debug:
            raise
        print(f"magi-attn {args.cmd}: error: {_one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
