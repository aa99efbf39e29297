"""The patched vLLM reads every VLLM_FORGE_* switch through the one validator the tool's profile check
uses (kernels/forge_switches.py, in the tree as vllm/forge_switches.py; patch "switches: ..."): a
value that is not one of the switch's values stops the read with the switch's name and values, never
read as another ("yes" was read as "0" before), and a good value reads as before."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

READ = """
import json, os
import vllm.envs as e
import vllm.forge_switches as fs
out = {"validator": open(fs.__file__).read()}
for name, value in json.loads(os.environ["CASES"]):
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        out[f"{name}={value}"] = ["ok", getattr(e, name)]
    except ValueError as x:
        out[f"{name}={value}"] = ["refused", str(x)]
print("RESULT" + json.dumps(out))
"""

GOOD = [("VLLM_FORGE_DECODE", "1", True), ("VLLM_FORGE_DECODE", "0", False), ("VLLM_FORGE_DECODE", None, True),
        ("VLLM_FORGE_PREFILL", "0", False), ("VLLM_FORGE_PREFILL_TILES", None, True),
        ("VLLM_FORGE_INT8_WRITE", "compiled", "compiled"), ("VLLM_FORGE_GEMV", None, "auto"),
        ("VLLM_FORGE_GEMV", "1", "1"), ("VLLM_FORGE_GEMV_SHAPES", "96x5120, 128x256/1", "96x5120, 128x256/1"),
        ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/16,5120x17408/9", "5120x17408/16,5120x17408/9"),
        ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/12=mma, 5120x17408/1", "5120x17408/12=mma, 5120x17408/1"),
        ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/32=mma,5120x17408/24=mma", "5120x17408/32=mma,5120x17408/24=mma"),
        ("VLLM_FORGE_CUSTOM_AR", None, "auto")]
BAD = [("VLLM_FORGE_DECODE", "yes"), ("VLLM_FORGE_DECODE", "true"), ("VLLM_FORGE_PREFILL", "on"),
       ("VLLM_FORGE_PREFILL_TILES", "2"), ("VLLM_FORGE_INT8_WRITE", "fast"), ("VLLM_FORGE_GEMV", "maybe"),
       ("VLLM_FORGE_GEMV_SHAPES", "14336by5120"), ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/17"),
       ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/0"), ("VLLM_FORGE_GEMV_SHAPES", "5120x17408=mma"),
       ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/12=MMA"), ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/24"),
       ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/33=mma"), ("VLLM_FORGE_GEMV_SHAPES", "5120x17408/12=mma,5120x17408/12"),
       ("VLLM_FORGE_CUSTOM_AR", "yes"), ("VLLM_FORGE_DECODE", "1\n")]


@pytest.fixture(scope="module")
def read(run_in_vllm):
    cases = [(n, v) for n, v, _ in GOOD] + BAD
    res = run_in_vllm(READ, env={"CASES": json.dumps(cases)})
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_the_tree_reads_the_switches_with_the_checkouts_validator(read):
    assert read["validator"] == (ROOT / "kernels" / "forge_switches.py").read_text()


@pytest.mark.parametrize("name,value,want", GOOD)
def test_a_good_value_reads_as_written(read, name, value, want):
    assert read[f"{name}={value}"] == ["ok", want]


@pytest.mark.parametrize("name,value", BAD)
def test_a_value_that_is_not_one_of_the_switchs_values_is_refused(read, name, value):
    how, msg = read[f"{name}={value}"]
    assert how == "refused" and name in msg and repr(value) in msg, msg
