"""Registers and spills of the Triton kernels, compiled for a GPU target on any machine (no GPU).

Compiles ``_fwd_kernel`` / ``_bwd_kernel`` for sm_90a with the bench's specialisation (bf16,
16-byte aligned pointers) and prints ptxas' register count and stack frame, then for each
loop of the SASS with tensor-core instructions its length and its local-memory loads/stores
(spills inside a hot loop are what costs time; a stack frame alone may be cold).

Usage: python bench/kernel_regs.py bwd BM1=64 "BM1=32,warps=8,stages=3" fwd "BN=64,TMA=False" gluon STAGES=3 gluon_bwd STAGES=2
(each argument after ``fwd``/``bwd``/``gluon``/``gluon_bwd`` is one config of that kernel's constexprs;
``gluon`` and ``gluon_bwd`` are the warp-specialised kernels of ``magi_kernels.gluon_fwd`` / ``gluon_bwd``.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from magi_kernels import triton_backend as tb

FLOATS = ("scale", "qk_scale", "cap_in", "cap_out")


def _source(fn, ptr: dict[str, str], constexprs: dict, cls=ASTSource) -> ASTSource:
    sig = {n: ptr.get(n, "constexpr") for n in fn.arg_names}
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
               for n, t in ptr.items() if n not in FLOATS and not t.startswith("tensordesc")}
    return cls(fn, sig, constexprs, attrs=aligned)


def bwd_source(BM1=32, BN1=128, BM2=128, BN2=64, D=128, GROUP=6, DQ_MODE=0, DO_Q=True) -> ASTSource:
    f32 = ("LSE2", "DELTA", "DQ", "DQD", "DK", "DV")
    ptr = {n: "*bf16" for n in ("Q", "K", "V", "DO")} | {n: "*fp32" for n in f32}
    if DQ_MODE == 2:
        ptr["DQD"] = f"tensordesc<fp32[{BM1},{D}]>"
    ptr |= {n: "*i32" for n in ("KV_META", "KV_TILES", "KV_MEMBERS", "Q_META", "Q_TILES", "Q_MEMBERS")}
    ptr |= {n: "i32" for n in ("n_kv", "T", "HQ")} | {n: "fp32" for n in FLOATS}
    cst = dict(GROUP=GROUP, BM1=BM1, BN1=BN1, BM2=BM2, BN2=BN2, D=D, HAS_SOFTCAP=False, ACCUM=False,
               DO_KV=True, DO_Q=DO_Q, DQ_MODE=DQ_MODE)
    return _source(tb._bwd_kernel, ptr, cst)


def fwd_source(BM=128, BN=128, D=128, GROUP=6, TMA=True) -> ASTSource:
    desc = f"tensordesc<bf16[{BN},{D}]>" if TMA else "*bf16"
    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KD": desc, "VD": desc, "O": "*bf16", "LSE": "*fp32",
           "META": "*i32", "TILES": "*i32", "MEMBERS": "*i32", "HQ": "i32"} | {n: "fp32" for n in FLOATS[1:]}
    cst = dict(GROUP=GROUP, BM=BM, BN=BN, D=D, HAS_SOFTCAP=False, ACCUM=False, TMA=TMA)
    return _source(tb._fwd_kernel, ptr, cst)


def _gluon_desc(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """Signature type of a TMA descriptor argument of a Gluon kernel: a rows x cols box in the
    shared layout the launches use (``gluon_common.shared_layout``)."""
    from magi_kernels.gluon_common import shared_layout

    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    return f"tensordesc<{name}[{rows},{cols}],{shared_layout(rows, cols, dtype)!r}>"


def gluon_fwd_source(BN=128, D=128, GROUP=6, STAGES=2, BM=128, PARTS=2, PING=True, HAS_SOFTCAP=False,
                     ACCUM=False) -> ASTSource:
    """The warp-specialised Gluon forward (``magi_kernels.gluon_fwd``) with the bench's
    specialisation."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from magi_kernels import gluon_fwd as gf

    ptr = {"q_desc": _gluon_desc(BM, D), "k_desc": _gluon_desc(BN, D), "v_desc": _gluon_desc(BN, D), "O": "*bf16", "LSE": "*fp32",
           "META": "*i32", "TILES": "*i32", "MEMBERS": "*i32", "QUEUE": "*i32", "HQ": "i32",
           "N_TILES": "i32"} | {n: "fp32" for n in FLOATS[1:]}
    cst = dict(GROUP=GROUP, BM=BM, BN=BN, D=D, STAGES=STAGES, HAS_SOFTCAP=HAS_SOFTCAP, ACCUM=ACCUM, PARTS=PARTS,
               PING=PING)
    return _source(gf._fwd_ws_kernel, ptr, cst, GluonASTSource)


def gluon_bwd_source(BN=128, D=128, GROUP=6, STAGES=None, BM=64, ROTATE=True, PIECE_TMA=0) -> ASTSource:
    """The warp-specialised Gluon backward (``magi_kernels.gluon_bwd``) with the bench's
    specialisation; ``STAGES`` left out is the library's ring depth, so a bare ``gluon_bwd``
    argument reports the kernel that runs."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from magi_kernels import gluon_bwd as gb

    if STAGES is None:
        STAGES = gb.CONFIGS[D][2]

    ptr = {"q_desc": _gluon_desc(BM, D), "k_desc": _gluon_desc(BN, D), "v_desc": _gluon_desc(BN, D),
           "do_desc": _gluon_desc(BM, D), "dq_desc": _gluon_desc(BM, D // 2, torch.float32),
           "dk_desc": _gluon_desc(BN // 2, D // 2, torch.float32),
           "dv_desc": _gluon_desc(BN // 2, D // 2, torch.float32), "DK": "*fp32", "DV": "*fp32", "LSE2": "*fp32",
           "DELTA": "*fp32", "META": "*i32", "TILES": "*i32", "MEMBERS": "*i32", "ORDER": "*i32", "N_TILES": "i32", "T": "i32",
           "HQ": "i32"}
    ptr |= {n: "fp32" for n in FLOATS}
    cst = dict(GROUP=GROUP, BM=BM, BN=BN, D=D, STAGES=STAGES, HAS_SOFTCAP=False, ACCUM=False, ROTATE=ROTATE,
               PIECE_TMA=PIECE_TMA)
    return _source(gb._bwd_ws_kernel, ptr, cst, GluonASTSource)


def triton_tool(name: str) -> str:
    """Path of a CUDA tool that ships in the Triton wheel (ptxas, cuobjdump, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


# an instruction of cuobjdump's listing: address, text, then the two 64-bit words of its encoding
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s*(.*?);"
                          r"\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*/\*\s*0x([0-9a-f]{16})\s*\*/")


def stall_cycles(high_word: int) -> int:
    """The stall count of an sm_90 instruction (bits 41-44 of its encoding's high word): the
    cycles before the warp may issue its next instruction, whatever that one waits for. Summed
    over a loop body it is one warp's issue floor per iteration (scoreboard waits come on top)."""
    return (high_word >> 41) & 0xF


def loops(sass: str) -> list[dict]:
    """Loops (backward branches) of a SASS listing that issue tensor-core instructions:
    address range, instruction count, HGMMA, wgmma waits, local-memory (spill) loads/stores,
    the summed stall counts (``stall_cycles``) and barrier instructions, and whether the loop
    is innermost."""
    ins = [(int(m.group(1), 16), m.group(2), int(m.group(4), 16)) for m in _INSTRUCTION.finditer(sass)]
    spans = []
    for addr, text, _ in ins:
        target = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            spans.append((int(target.group(1), 16), addr))
    out = []
    for lo, hi in spans:
        body = [(t, w) for a, t, w in ins if lo <= a <= hi]
        n = lambda key: sum(key in t for t, _ in body)  # noqa: E731
        if n("HGMMA"):
            inner = not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans)
            out.append(dict(start=lo, end=hi, instructions=len(body), hgmma=n("HGMMA"), ldl=n("LDL"),
                            stl=n("STL"), wgmma_waits=n("WARPGROUP.DEPBAR"), innermost=inner,
                            stalls=sum(stall_cycles(w) for _, w in body), mufu=n("MUFU"), bar=n("BAR."),
                            syncs=n("SYNCS")))
    return out


def compile_report(src: ASTSource, warps: int, stages: int, **options) -> tuple[str, list[dict]]:
    """(ptxas resource line with the shared memory in bytes, loops) of ``src`` compiled for sm_90a."""
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages, **options))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([triton_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([triton_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    regs = next(line.split()[:2] for line in usage.splitlines() if "REG:" in line)
    return " ".join(regs) + f" SHARED:{kernel.metadata.shared}", loops(sass)


def main(argv: list[str]) -> int:
    kind = "bwd"
    for arg in argv:
        if arg in ("fwd", "bwd", "gluon", "gluon_bwd"):
            kind = arg
            continue
        kw = {k: eval(v) for k, v in (item.split("=") for item in arg.split(",") if item)}  # noqa: S307 - CLI
        if kind == "gluon":  # constexprs of magi_kernels.gluon_fwd; warps follow PARTS
            from magi_kernels import gluon_fwd as gf

            warps, stages = 8 // kw.get("PARTS", 2), 1
            regs, found = compile_report(gluon_fwd_source(**kw), warps, stages, maxnreg=gf.MAX_REGS)
        elif kind == "gluon_bwd":
            from magi_kernels import gluon_bwd as gb

            warps, stages = 4, 1
            regs, found = compile_report(gluon_bwd_source(**kw), warps, stages, maxnreg=gb.MAX_REGS)
        else:
            warps, stages = kw.pop("warps", 8), kw.pop("stages", 3)
            regs, found = compile_report((bwd_source if kind == "bwd" else fwd_source)(**kw), warps, stages)
        print(f"{kind} {arg} (warps {warps}, stages {stages}): {regs}")
        for lp in found:
            print(f"  {'inner' if lp['innermost'] else 'outer'} loop {lp['start']:x}-{lp['end']:x}: "
                  f"{lp['instructions']} instructions, HGMMA {lp['hgmma']} (waits {lp['wgmma_waits']}), "
                  f"LDL {lp['ldl']}, STL {lp['stl']}, stall cycles {lp['stalls']}, MUFU {lp['mufu']}, "
                  f"BAR {lp['bar']}, SYNCS {lp['syncs']}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["bwd", "BM1=32", "BM1=64", "fwd", "TMA=True"]))
