"""`forge calibrate --tp N`: one rank's heads from the model's config, the table's validators and file
name carry the degree, and a degree the model cannot run is refused before anything is measured."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from forge import tunedtable  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.run import rank_geometry as R  # noqa: E402


def test_rank_heads_follow_the_model_config():
    assert [R.rank_heads(tp) for tp in (1, 2, 4, 8)] == [(24, 4), (12, 2), (6, 1), (3, 1)]
    assert R.validators(2) == {"tp": 2, "heads": [12, 2]}
    assert R.worker_args(1) == [] and R.worker_args(8) == ["--tp", "8", "--heads", "3,1"]
    assert R.suffix(1) == "" and R.suffix(2) == "-tp2" and R.options(1) == {} and R.options(4) == {"tp": 4}
    # from whatever config is given: a model with 8 KV heads splits them to 2 at TP4
    cfg = dict(tunedtable.model_config(), num_key_value_heads=8)
    assert R.rank_heads(4, cfg) == (6, 2)


@pytest.mark.parametrize("tp,what", [(3, "16 GDN key heads"), (5, "24 query heads")])
def test_a_degree_that_does_not_divide_the_heads_is_refused(tp, what):
    with pytest.raises(ForgeError, match=what):
        R.rank_heads(tp)


def run(*args):
    return subprocess.run([sys.executable, "-m", "forge", "calibrate", *args], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/bin:/bin"}, timeout=120)


@pytest.mark.parametrize("arg,msg", [("0", "not a tensor-parallel degree"), ("x", "not a tensor-parallel degree"),
                                     ("3", "does not divide the model's 16 GDN key heads")])
def test_the_cli_refuses_a_bad_degree_in_one_line(tmp_path, arg, msg):
    r = run("--tp", arg, "--smoke", "--out", str(tmp_path / "cal"))
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "cal").exists()


def test_the_gemv_calibration_measures_one_ranks_linear_shapes():
    """kernels/calibrate's per-rank linear shapes (what `calibrate --tp N` times and writes into the
    table's gemv section) against the benchmark's, derived on its own from the model's config.json."""
    import importlib.util
    import json
    sys.path.insert(0, str(ROOT / "kernels"))
    from calibrate import common as C
    spec = importlib.util.spec_from_file_location("bench_skinny", ROOT / "kernels" / "bench" / "bench_skinny.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = json.loads((ROOT / "configs" / "models" / "qwen3.5-27b" / "config.json").read_text())
    for tp in (1, 2, 4):
        ours = {(n, k) for _, n, k in C.linear(tp)}
        theirs = {(n, k) for _, n, k in bench.shapes(config, tp)}
        assert ours == theirs, tp
    # the public per-rank shapes at TP2 (contest-facts, "The final round")
    tp2 = dict((layer, (n, k)) for layer, n, k in C.linear(2))
    assert tp2["gate_up"] == (17408, 5120) and tp2["down"] == (5120, 8704) and tp2["lm_head"] == (124160, 5120)
    assert tp2["in_proj_qkvz"] == (8192, 5120) and tp2["o_proj/out_proj"] == (5120, 3072)
