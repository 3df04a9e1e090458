"""The distributed benchmark runs end to end on 2 gloo processes (tiny sizes)."""

import os
import subprocess
import sys


def test_bench_dist_smoke(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "d.json"
    subprocess.run([sys.executable, os.path.join(root, "bench", "bench_dist.py"), "--cp", "2", "--tokens-per-rank", "128",
                    "--masks", "varlen_causal", "--heads-q", "4", "--heads-kv", "2", "--head-dim", "8", "--iters", "1",
                    "--out", str(out)], check=True, timeout=300)
    import json

    rows = json.loads(out.read_text())["rows"]
    assert rows and rows[0]["magi_fwd_bytes_received"] == rows[0]["magi_fwd_bytes_plan"]
