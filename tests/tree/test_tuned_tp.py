"""Inside the patched vLLM, the tuned-table loader (vllm/forge_tuned) learns the running tensor-parallel
degree from vLLM's parallel state, and takes a table only at the degree it was measured for: a TP1 table
is refused at TP2 (and a TP2 table at TP1) with the reason in the log, and the built-in defaults run."""

import json
import textwrap

import pytest

SNIPPET = textwrap.dedent(
    """
    import json, logging, os, types
    import vllm.forge_tuned as T
    from vllm.distributed import parallel_state as ps
    logs = []
    class Keep(logging.Handler):
        def emit(self, r):
            logs.append(r.getMessage())
    T.logger.disabled = False
    T.logger.addHandler(Keep())
    T.logger.setLevel(logging.INFO)
    ident = T.device_identity()
    tp, heads = int(os.environ["TABLE_TP"]), json.loads(os.environ["TABLE_HEADS"])
    table = {"schema": T.SCHEMA, "validators": {**{k: ident[k] for k in T.MATCH}, "tp": tp, "heads": heads},
             "provenance": {}, "decode": {"segments": {str(heads[1]): {"1": {"32768": 32}}}}}
    path = os.path.join(os.environ["TMP"], "table.json")
    with open(path, "w") as f:
        json.dump(table, f)
    os.environ["VLLM_FORGE_TUNED"] = path
    out = {"before_init": T.running_tp()}
    # what vLLM's worker has set up before it builds the model: the TP and PP groups
    running = int(os.environ["RUNNING_TP"])
    ps._TP = types.SimpleNamespace(world_size=running)
    ps._PP = types.SimpleNamespace(world_size=1)
    out["running"] = T.running_tp()
    out["table"] = T.active() is not None
    out["segments"] = T.decode_segments(1, heads[1], 32768)
    out["logs"] = logs
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.parametrize("table_tp,heads,running", [(1, [24, 4], 2), (2, [12, 2], 1), (2, [12, 2], 2)])
def test_the_loader_takes_a_table_only_at_the_running_degree(run_in_vllm, tmp_path, table_tp, heads, running):
    res = run_in_vllm(SNIPPET, env={"TMP": str(tmp_path), "TABLE_TP": str(table_tp), "TABLE_HEADS": json.dumps(heads),
                                    "RUNNING_TP": str(running)})
    r = json.loads(next(l for l in res.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    assert r["before_init"] is None and r["running"] == running
    logs = " | ".join(r["logs"])
    if table_tp == running:
        assert r["table"] and r["segments"] == 32, logs
    else:
        assert not r["table"] and r["segments"] is None, logs
        assert f"measured at tensor-parallel degree {table_tp}" in logs and f"runs {running}" in logs
        assert "built-in defaults" in logs and f"tensor-parallel degree {running})" in logs
