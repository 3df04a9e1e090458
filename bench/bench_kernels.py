"""Kernel benchmark on one GPU: magi vs FlexAttention (compiled), cuDNN SDPA and FlashAttention-4
(its own API, and through FlexAttention's FLASH backend: see bench/fa4_peer.py), same process.

TFLOP/s count only the unmasked area: fwd = 4 * area * hq * d, bwd = 2.5 * fwd.
Usage: python bench/bench_kernels.py --seqlens 8192 16384 32768 --out results.json [--plot plot.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
import torch.nn.functional as F

from magi_attn import make_mask
from magi_solver import slice_ranges
from magi_kernels import KernelConfig, clear_caches, default_kernel_config, flex_flash_attn_func, plan_attention

from fa4_peer import fa4_missing, fa4_native, fa4_through_flex

MASKS = ["full", "causal", "varlen_full", "varlen_causal", "sliding_window", "varlen_block_causal", "shared_prefix"]
PEERS = ("flex", "cudnn", "fa4", "fa4flex")
IMPLS = ("magi",) + PEERS


def row_intervals(slices, S, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-query ``[lo, hi)`` key intervals: one pair of tensors for each interval a row can have
    (one for most benchmark masks, two for shared_prefix: the prefix and the row's own document);
    a row with fewer intervals gets empty ones."""
    ivals: list[tuple[torch.Tensor, torch.Tensor]] = []
    used = torch.zeros(S, dtype=torch.long)  # intervals given to each row so far
    for s in slices:
        for p in s.band().pieces():
            q = torch.arange(p.q_start, p.q_end)
            l = torch.clamp(q + p.diag_lo, min=p.k_lo) if p.diag_lo > -(1 << 61) else torch.full_like(q, p.k_lo)
            h = torch.clamp(q + p.diag_hi, max=p.k_hi) if p.diag_hi < (1 << 61) else torch.full_like(q, p.k_hi)
            slot = used[p.q_start:p.q_end]
            for j in range(int(slot.max()) + 1 if len(slot) else 0):
                if j == len(ivals):
                    ivals.append((torch.zeros(S, dtype=torch.int32), torch.zeros(S, dtype=torch.int32)))
                rows = q[slot == j]
                ivals[j][0][rows], ivals[j][1][rows] = l[slot == j].int(), h[slot == j].int()
            used[p.q_start:p.q_end] += 1
    return [(lo.to(device), hi.to(device)) for lo, hi in ivals]


def softcap_score_mod(cap: float):
    """FlexAttention's ``score_mod`` for a tanh softcap of the scaled logits (magi's and FA4's
    ``softcap``: ``cap * tanh(s / cap)``), or None for no cap."""
    if not cap:
        return None

    def score_mod(score, b, h, qi, ki):
        return cap * torch.tanh(score / cap)

    return score_mod


def bench(fn, reps_ms=200):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median")


def interleaved_times(fns: dict, rounds: int, reps_ms: float, timer=bench, windows: dict | None = None,
                      samples: dict | None = None) -> dict:
    """Median ms of each callable over ``rounds`` rounds; each round times every callable once
    (``reps_ms`` of back-to-back calls), starting one later each round. Under the H200's 700 W
    cap the SM clock falls from 1980 to 1620-1800 MHz with sustained load and recovers in idle
    gaps, so timing each implementation in one block would favour whichever follows
    a gap (Flex after its compile); interleaving gives every one the same mix of clocks.
    ``windows``, if given, collects each callable's wall-clock spans ``[t0, t1]`` (one per round)
    for ``bench/gpu_clocks.py`` to read the SM clock each ran under; ``samples``, if given, gets
    every round's ms per callable (the spread behind each median)."""
    names = list(fns)
    times = {n: [] for n in names}
    try:  # heat, untimed: after the row's setup (compiles) the first timing would get the idle clock
        timer(fns[names[0]], reps_ms)
    except Exception:  # noqa: BLE001 - its timed rounds report the error
        pass
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            try:
                t0 = time.time()
                times[n].append(timer(fns[n], reps_ms))
                if windows is not None:
                    windows.setdefault(n, []).append([round(t0, 3), round(time.time(), 3)])
            except Exception as e:  # noqa: BLE001 - one failing peer must not lose the others' times
                print(f"{n}: {e!r}"[:300], file=sys.stderr)
    if samples is not None:
        samples.update({n: [round(x, 4) for x in t] for n, t in times.items() if t})
    return {n: sorted(t)[len(t) // 2] for n, t in times.items() if t}


def run(args, on_row=lambda rows: None):
    """Time every (seqlen, mask) of ``args``; ``on_row(rows)`` after each row (so a timeout keeps results).

    Per row: every implementation (ours, our Triton kernels as an A/B, Flex, cuDNN) is set up and
    run once (compiles, caches), then all are timed in ``args.rounds`` interleaved rounds."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # the timing loop calls backward with retain_graph=True, which a compiled backward with
    # donated buffers refuses (it did at 32k after the shapes changed)
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
    flex = torch.compile(flex_attention, dynamic=False)
    # torch's replacement of the deprecated create_block_mask(_compile=True): the eager path
    # materialises S x S intermediates (OOM at 32k on the varlen masks)
    compiled_block_mask = torch.compile(create_block_mask)
    rows = []
    for S in args.seqlens:
        for mask in args.masks:
            rows.append(time_row(args, S, mask, flex, compiled_block_mask))
            on_row(rows)
            torch.cuda.empty_cache()  # the row's tensors are gone with time_row's frame
    return rows


def time_row(args, S: int, mask: str, flex, compiled_block_mask) -> dict:
    """Set up magi and every peer of ``args.peers`` on one (seqlen, mask), check the peers' outputs and
    gradients against magi's, and time all of them in ``args.rounds`` interleaved rounds (one result row)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    dev = torch.device("cuda")
    hq, hk, d = args.heads_q, args.heads_kv, args.head_dim
    slices = make_mask(mask, S, window=args.window, block=args.block, seed=0)
    area = sum(s.area for s in slices)
    fl_f = 4 * area * hq * d
    qr, kr, tm = (torch.tensor(x, dtype=torch.int32) for x in slice_ranges(slices))  # CPU: no sync
    torch.manual_seed(0)
    q = torch.randn(S, hq, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(S, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(S, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(S, hq, d, device=dev, dtype=torch.bfloat16)
    # a learnable sink per query head (GPT-OSS), fp32 like the models' parameter
    sink = torch.randn(hq, device=dev, dtype=torch.float32, requires_grad=True) if args.sink else None
    res = {"seqlen": S, "mask": mask, "area": area, "density": area / S / S, "rounds": args.rounds}

    def ours(config: KernelConfig | None = None):
        return flex_flash_attn_func(q, k, v, qr, kr, tm, backend="triton", check_ranges=False,
                                    kernel_config=config, softcap=args.softcap, sink=sink)[0]

    o = ours()
    fns = {"magi_fwd": ours, "magi_bwd": lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)}
    # A/B: the Triton kernels in the same process, where the Gluon ones run by default
    plan = plan_attention(qr, kr, tm, S, S, (hq, hk), d, q.dtype, device=dev)
    res["plan"] = str(plan)
    triton_only = dataclasses.replace(default_kernel_config(), gluon_fwd=False, gluon_bwd=False)
    if args.triton_ab and plan.forward.kernel == "gluon":
        fns["magi_triton_fwd"] = lambda: ours(triton_only)
    if args.triton_ab and plan.backward.kernel == "gluon":
        o_t = ours(triton_only)
        fns["magi_triton_bwd"] = lambda: torch.autograd.grad(o_t, (q, k, v), g, retain_graph=True)
    for fn in fns.values():
        fn()
    res.update(metadata_ms(q, k, v, qr, kr, tm))

    qf, kf, vf = (t.detach().transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v))
    gf = g.transpose(0, 1).unsqueeze(0)
    bm = None
    score_mod = softcap_score_mod(args.softcap)
    if not args.no_peers and sink is not None and {"flex", "fa4flex"} & set(args.peers):
        res.update({f"{p}_error": "FlexAttention has no attention sink" for p in ("flex", "fa4flex") if p in args.peers})
    elif not args.no_peers and {"flex", "fa4flex"} & set(args.peers):
        try:
            # each row's mask is a new function to Dynamo: without a reset the ninth row passes
            # its recompile limit and Flex silently runs unfused (OOM at 32k)
            torch._dynamo.reset()
            if mask == "full":
                bm = None
            elif mask == "causal":
                bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=dev)
            else:
                ivals = row_intervals(slices, S, dev)
                if len(ivals) == 1:
                    (lo, hi), = ivals

                    def mask_fn(b, h, qi, ki):
                        return (ki >= lo[qi]) & (ki < hi[qi])
                else:  # shared_prefix: the prefix and the row's own document
                    (lo, hi), (lo2, hi2) = ivals

                    def mask_fn(b, h, qi, ki):
                        return ((ki >= lo[qi]) & (ki < hi[qi])) | ((ki >= lo2[qi]) & (ki < hi2[qi]))
                bm = compiled_block_mask(mask_fn, None, None, S, S, device=dev)

            def fx():
                return flex(qf, kf, vf, score_mod=score_mod, block_mask=bm, enable_gqa=True)

            if "flex" in args.peers:
                add_peer(fns, res, "flex", fx, (qf, kf, vf), gf, o, heads_first=True)
        except Exception as e:  # noqa: BLE001 - report and continue
            res["flex_error"] = repr(e)[:200]
            fns.pop("flex_fwd", None), fns.pop("flex_bwd", None)
    if not args.no_peers and {"fa4", "fa4flex"} & set(args.peers):
        if (why := fa4_missing()) is not None:
            res["fa4_error"] = why
        if why is None and "fa4" in args.peers:
            qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
            sink_a = None if sink is None else sink.detach().clone().requires_grad_()
            try:
                if (fa4_fwd := fa4_native(mask, slices, qa, ka, va, args.window, args.softcap, sink_a)) is not None:
                    add_peer(fns, res, "fa4", fa4_fwd, (qa, ka, va), g, o)
            except Exception as e:  # noqa: BLE001
                res["fa4_error"] = repr(e)[:300]
                fns.pop("fa4_fwd", None), fns.pop("fa4_bwd", None)
        if why is None and "fa4flex" in args.peers and sink is None and (bm is not None or mask == "full"):
            qb, kb, vb = (t.detach().clone().requires_grad_() for t in (qf, kf, vf))
            try:
                add_peer(fns, res, "fa4flex", fa4_through_flex(flex, qb, kb, vb, bm, score_mod), (qb, kb, vb), gf, o,
                         heads_first=True)
            except Exception as e:  # noqa: BLE001
                res["fa4flex_error"] = repr(e)[:300]
                fns.pop("fa4flex_fwd", None), fns.pop("fa4flex_bwd", None)
    if not args.no_peers and "cudnn" in args.peers:
        if args.softcap or sink is not None:
            res["cudnn_error"] = "cuDNN SDPA has no softcap or attention sink"
        elif mask in ("full", "causal"):
            kr_, vr_ = (t.repeat_interleave(hq // hk, dim=1).detach().requires_grad_() for t in (kf, vf))
            try:
                def cd():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(qf, kr_, vr_, is_causal=mask == "causal")

                oc = cd()
                fns["cudnn_fwd"] = cd
                fns["cudnn_bwd"] = lambda: torch.autograd.grad(oc, (qf, kr_, vr_), gf, retain_graph=True)
                fns["cudnn_bwd"]()
            except Exception as e:  # noqa: BLE001
                res["cudnn_error"] = repr(e)[:200]
                fns.pop("cudnn_fwd", None), fns.pop("cudnn_bwd", None)
    res["timing_windows"] = {}  # wall-clock spans per implementation: bench/gpu_clocks.py
    res["round_ms"] = {}  # every round's ms per implementation (the median's spread)
    for name, ms in interleaved_times(fns, args.rounds, args.rep_ms, windows=res["timing_windows"],
                                      samples=res["round_ms"]).items():
        res[f"{name}_ms"] = ms
        res[f"{name}_tflops"] = (2.5 if name.endswith("bwd") else 1.0) * fl_f / ms / 1e9
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()
                      if k not in ("timing_windows", "round_ms")}), flush=True)
    return res


def add_peer(fns: dict, res: dict, name: str, fwd, inputs: tuple, grad_out, magi_out, heads_first: bool = False):
    """Run a peer's forward and backward once, check both against magi's (bf16 both sides: the
    largest differences were 0.001-0.06 on an H100) and add ``{name}_fwd`` / ``{name}_bwd`` to ``fns``.
    ``heads_first``: the peer works on ``[1, h, S, d]`` tensors rather than ``[S, h, d]``."""
    def as_shd(t):
        return t[0].transpose(0, 1) if heads_first else t

    out = fwd()
    fns[f"{name}_fwd"] = fwd
    fns[f"{name}_bwd"] = lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
    res[f"{name}_vs_magi_maxerr"] = (as_shd(out).float() - magi_out.float()).abs().max().item()
    res[f"{name}_vs_magi_grad_maxerr"] = max((as_shd(a).float() - b.float()).abs().max().item()
                                             for a, b in zip(fns[f"{name}_bwd"](), fns["magi_bwd"]()))


def metadata_ms(q, k, v, qr, kr, tm) -> dict[str, float]:
    """Host cost of the forward's mask metadata: ``magi_meta_ms`` per call with the plan cached
    (the same mask again: slice table + plan lookup), ``magi_meta_build_ms`` building it for a
    mask not seen before (a new document layout each step: slice table, tile tables, their
    upload), timed with the GPU idle, and ``magi_meta_build_busy_ms`` the same build right after
    queueing a forward: equal to the idle build when the upload does not wait for the queued
    kernels, a forward's time more if it does (a syncing copy)."""
    shape = (q.shape[0], k.shape[0], (q.shape[1], k.shape[1]), q.shape[-1], q.dtype)

    def lookup():
        return plan_attention(qr, kr, tm, *shape, device=q.device).forward

    lookup()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):  # the forward above filled the caches
        lookup()
    t1 = time.perf_counter()

    def build_new() -> float:
        clear_caches()  # a mask not seen before (the next calls rebuild this one's plan once)
        t = time.perf_counter()
        _ = plan_attention(qr.clone(), kr.clone(), tm.clone(), *shape, device=q.device).forward  # builds it
        return (time.perf_counter() - t) * 1e3

    build = build_new()
    torch.cuda.synchronize()
    flex_flash_attn_func(q, k, v, qr, kr, tm, backend="triton")  # queued, cached tables: no wait here
    busy = build_new()
    torch.cuda.synchronize()
    return {"magi_meta_ms": (t1 - t0) / 100 * 1e3, "magi_meta_build_ms": build, "magi_meta_build_busy_ms": busy}


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqlens = sorted({r["seqlen"] for r in rows})
    masks = [m for m in MASKS if any(r["mask"] == m for r in rows)]
    fig, axes = plt.subplots(2, len(seqlens), figsize=(max(7.5, 5 * len(seqlens)), 7), squeeze=False)
    for j, S in enumerate(seqlens):
        for i, pas in enumerate(("fwd", "bwd")):
            ax = axes[i][j]
            impls = [i for i in IMPLS if any(r.get(f"{i}_{pas}_tflops") for r in rows)]
            width = 0.8 / len(impls)
            for o, impl in enumerate(impls):
                vals = [next((r.get(f"{impl}_{pas}_tflops", 0) for r in rows if r["seqlen"] == S and r["mask"] == m), 0)
                        for m in masks]
                ax.bar([x + width * (o - (len(impls) - 1) / 2) for x in range(len(masks))], vals, width, label=impl)
            ax.set_xticks(range(len(masks)))
            ax.set_xticklabels(masks, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{pas}, {S // 1024}k tokens")
            ax.set_ylabel("TFLOP/s (unmasked area)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    # one legend, under the title line: none covers a bar or the title
    fig.legend(handles, labels, loc="upper right", bbox_to_anchor=(0.99, 0.96), ncol=len(labels), fontsize=9)
    fig.suptitle(title, fontsize=10, x=0.02, y=0.99, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.91))
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--masks", nargs="+", default=MASKS)
    p.add_argument("--heads-q", type=int, default=48)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--softcap", type=float, default=0.0, help="tanh softcap of the logits (0: none), on every peer "
                   "that has one (Flex through score_mod, FA4); cuDNN is skipped")
    p.add_argument("--sink", action="store_true", help="a learnable sink logit per query head (GPT-OSS): magi and "
                   "FA4's own API; Flex and cuDNN have none and are skipped")
    p.add_argument("--out", default="bench_results.json")
    p.add_argument("--plot", default=None)
    p.add_argument("--no-peers", action="store_true", help="only time magi (tuning runs)")
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS,
                   help="peers to time beside magi (fa4, fa4flex: when flash-attn-4 imports)")
    p.add_argument("--no-triton-ab", dest="triton_ab", action="store_false",
                   help="skip timing the Triton kernels beside the Gluon ones (a shorter run)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per row (median)")
    p.add_argument("--rep-ms", type=float, default=150, help="ms of back-to-back calls per timing")
    p.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="no timing: merge these result files (later rows win) into --out, --plot and a table")
    args = p.parse_args()
    if args.from_json:
        meta, rows = merge_results(args.from_json)
    else:
        import triton

        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "config": vars(args)}

        def save(rows):
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)

        rows = run(args, on_row=save)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    cfg = meta.get("config", {})
    if args.plot:
        extras = (f" softcap={cfg['softcap']:g}" if cfg.get("softcap") else "") + (" sink" if cfg.get("sink") else "")
        plot(rows, args.plot, f"{meta['device']}, b=1 hq={cfg.get('heads_q')} hk={cfg.get('heads_kv')} "
                              f"d={cfg.get('head_dim')} bf16{extras}")
    print(markdown_table(rows))


def merge_results(paths: list[str]) -> tuple[dict, list[dict]]:
    """Rows of several result files keyed by (seqlen, mask); a later file replaces an earlier row."""
    meta, by_key = {}, {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = meta or data["meta"]
        for r in data["rows"]:
            by_key[(r["seqlen"], r["mask"])] = r
    order = {m: i for i, m in enumerate(MASKS)}
    return meta, sorted(by_key.values(), key=lambda r: (r["seqlen"], order.get(r["mask"], len(order))))


def markdown_table(rows: list[dict]) -> str:
    """TFLOP/s of magi and every peer present per (seqlen, mask), and magi's ratio to each."""
    def val(r, key):
        x = r.get(key)
        return f"{x:.0f}" if x else "-"

    def ratio(r, a, b):
        return f"{r[a] / r[b]:.2f}" if r.get(a) and r.get(b) else "-"

    peers = [i for i in IMPLS[1:] if any(r.get(f"{i}_fwd_tflops") or r.get(f"{i}_bwd_tflops") for r in rows)]
    head = ["seqlen", "mask"]
    for p in ("fwd", "bwd"):
        head += [f"magi {p}"] + [f"{i} {p}" for i in peers] + [f"/{i}" for i in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['seqlen'] // 1024}k", r["mask"]]
        for p in ("fwd", "bwd"):
            cells += [val(r, f"{i}_{p}_tflops") for i in ["magi"] + peers]
            cells += [ratio(r, f"magi_{p}_tflops", f"{i}_{p}_tflops") for i in peers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
