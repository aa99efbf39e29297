"""The patched vLLM's custom all-reduce decision (patch "custom-ar: on ROCm, custom all-reduce only over
XGMI-linked cards unless VLLM_FORGE_CUSTOM_AR=1"): CustomAllreduce is constructed on the CPU for a
two-rank group with the platform, the link check and the process group faked, and the test sees where
the constructor stops: disabled with the reason and the opt-in in its log, or on to allocating its IPC
buffers (stopped at its first step by a sentinel) as upstream does."""

import json
import textwrap

import pytest

SNIPPET = textwrap.dedent(
    """
    import json, logging, os, types
    import torch
    import vllm.envs as envs
    import vllm.distributed.device_communicators.custom_all_reduce as car

    class Reached(Exception):
        pass

    class Platform:
        def __init__(self, rocm, xgmi):
            self.rocm, self.xgmi = rocm, xgmi
        def is_rocm(self): return self.rocm
        def is_cuda(self): return not self.rocm
        def is_cuda_alike(self): return True
        def get_device_capability(self): return None
        def is_fully_connected(self, ids): return self.xgmi

    def gather(out, t, group=None):
        for i, o in enumerate(out):
            o.copy_(torch.tensor([i], dtype=torch.int))

    def stop(*a, **k):
        raise Reached

    records = []
    class Keep(logging.Handler):
        def emit(self, r): records.append(r.getMessage())
    car.logger.addHandler(Keep())
    car.custom_ar = True
    car.dist = types.SimpleNamespace(get_backend=lambda g: "gloo", Backend=torch.distributed.Backend,
                                     get_rank=lambda group=None: 0, get_world_size=lambda group=None: 2,
                                     all_gather=gather)
    car.in_the_same_node_as = lambda g, source_rank=0: [True, True]
    car._can_p2p = lambda rank, world: True
    car.cuda_device_count_stateless = lambda: 2
    car.ops = types.SimpleNamespace(meta_size=stop)       # the first step of allocating its buffers
    car.CustomAllreduce.__del__ = lambda self: None      # an object stopped half-built has nothing to close
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    out = {}
    for name, rocm, xgmi, setting in json.loads(os.environ["FORGE_TEST_CASES"]):
        if setting is None:
            os.environ.pop("VLLM_FORGE_CUSTOM_AR", None)
        else:
            os.environ["VLLM_FORGE_CUSTOM_AR"] = setting
        car.current_platform = Platform(rocm, xgmi)
        del records[:]
        try:
            ca = car.CustomAllreduce(group=None, device=0)
            out[name] = {"went_on": False, "disabled": ca.disabled, "log": list(records)}
        except Reached:
            out[name] = {"went_on": True, "log": list(records)}
    os.environ["VLLM_FORGE_CUSTOM_AR"] = "yes"
    try:
        envs.VLLM_FORGE_CUSTOM_AR
        out["unknown value"] = "accepted"
    except ValueError as e:
        out["unknown value"] = str(e)
    print("RESULT " + json.dumps(out))
    """
)

# (case, ROCm, XGMI-linked, VLLM_FORGE_CUSTOM_AR (None: unset), custom all-reduce goes on as upstream's)
CASES = [
    ("rocm pcie default", True, False, None, False),
    ("rocm pcie auto", True, False, "auto", False),
    ("rocm pcie opted in", True, False, "1", True),
    ("rocm xgmi default", True, True, None, True),
    ("cuda pcie default", False, False, None, True),
    ("cuda nvlink default", False, True, None, True),
]


@pytest.fixture(scope="module")
def decided(run_in_vllm, patched_tree):
    cases = [c[:4] for c in CASES]
    res = run_in_vllm(SNIPPET, env={"FORGE_TEST_CASES": json.dumps(cases), "VLLM_LOGGING_LEVEL": "INFO"})
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case,rocm,xgmi,setting,goes_on", CASES, ids=[c[0] for c in CASES])
def test_custom_allreduce_is_off_on_rocm_without_xgmi_unless_opted_in(decided, case, rocm, xgmi, setting, goes_on):
    got = decided[case]
    assert got["went_on"] is goes_on, got
    why = [m for m in got["log"] if "not linked by XGMI" in m]
    if goes_on:
        assert why == [], got
    else:
        assert got["disabled"] is True
        # the server log says why and how to opt in
        assert len(why) == 1 and "VLLM_FORGE_CUSTOM_AR=1" in why[0], got


def test_an_unknown_value_of_the_switch_is_refused(decided):
    assert "VLLM_FORGE_CUSTOM_AR" in decided["unknown value"] and "yes" in decided["unknown value"]
