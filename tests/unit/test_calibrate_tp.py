"""`forge calibrate --tp N`: one rank's heads from the model's config, the table's validators and file
name carry the degree, and a degree the model cannot run is refused before anything is measured."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from forge.errors import ForgeError  # noqa: E402
from forge.run import rank_geometry as R  # noqa: E402


def test_rank_heads_follow_the_model_config():
    assert [R.rank_heads(tp) for tp in (1, 2, 4, 8)] == [(24, 4), (12, 2), (6, 1), (3, 1)]
    assert R.validators(2) == {"tp": 2, "heads": [12, 2]}
    assert R.worker_args(1) == [] and R.worker_args(8) == ["--tp", "8", "--heads", "3,1"]
    assert R.suffix(1) == "" and R.suffix(2) == "-tp2" and R.options(1) == {} and R.options(4) == {"tp": 4}
    # from whatever config is given: a model with 8 KV heads splits them to 2 at TP4
    cfg = dict(R.model_config(), num_key_value_heads=8)
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
