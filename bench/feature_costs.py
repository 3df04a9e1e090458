"""What two opt-in features cost on one GPU, each beside the default in the same process:

* ``return_max_logits=True`` (Muon QK-clip): the forward with the per-head max logits (on sm90 at
  head dim 128 that is the Triton forward instead of the Gluon one);
* ``DistAttnConfig(deterministic=True)``: forward + backward of ``calc_attn`` on one rank (the
  deterministic kernels; the ordered GroupReduce needs several ranks and is not in this number).

b=1, 48 query / 8 KV heads, d=128, bf16, masks from ``magi_attn.make_mask``; times are medians of
``triton.testing.do_bench``. Usage: ``python bench/feature_costs.py --seqlens 16384 --out costs.json``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    import triton.testing

    from magi_attn import DistAttnConfig, calc_attn, dispatch, magi_attn_flex_key, make_mask
    from magi_kernels import flex_flash_attn_func

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    p.add_argument("--masks", nargs="+", default=["full", "causal", "varlen_causal"])
    p.add_argument("--out", default="feature_costs.json")
    args = p.parse_args()
    hq, hk, d = 48, 8, 128
    rows = []
    for S in args.seqlens:
        for mask in args.masks:
            slices = make_mask(mask, S, seed=0)
            qr, kr, tm = [s.q_range for s in slices], [s.k_range for s in slices], [s.mask_type for s in slices]
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(S, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hk, hk))
            fwd = lambda ml: flex_flash_attn_func(q, k, v, qr, kr, tm, return_max_logits=ml)  # noqa: E731
            row = {"seqlen": S, "mask": mask,
                   "fwd_ms": triton.testing.do_bench(lambda: fwd(False), rep=200),
                   "fwd_max_logits_ms": triton.testing.do_bench(lambda: fwd(True), rep=200)}
            qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
            go = torch.randn(S, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for det in (False, True):
                key = magi_attn_flex_key(qr, kr, tm, S, S, hq, hk, d, None, DistAttnConfig(deterministic=det))

                def step(key=key):
                    out, _ = calc_attn(dispatch(qd, key), dispatch(kd, key), dispatch(vd, key), key)
                    out.backward(go)
                row["fwd_bwd_deterministic_ms" if det else "fwd_bwd_ms"] = triton.testing.do_bench(step, rep=300)
            rows.append(row)
            print(json.dumps({k: round(x, 4) if isinstance(x, float) else x for k, x in row.items()}), file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
