"""forge sweep --round final end to end on a CPU box: the fake server (tests/support/fakeserver.py) stands
in for vLLM and the small client (benchclient.py) really talks to it; the finals' time model ranks the
space, the best --top N are served with their values, benchmarked with the finals' client and scored
per tier against the baseline the sweep measured; resumable; the winner per tier written once."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import SUPPORT, args_with, forge, free_port, health, probe_bundle, tiny_model  # noqa: E402

from forge.contest import rounds, rules  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.run import final_space, gpu_harness  # noqa: E402

FAKE = f"{sys.executable} {SUPPORT / 'fakeserver.py'}"
BENCH = f"{sys.executable} {SUPPORT / 'benchclient.py'}"
SPACE = ["--topologies", "tp2,dp2", "--kv-dtypes", "bf16,int8", "--max-num-seqs", "64",
         "--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.95", "--concurrency", "8"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def _sweep(tmp_path, model, *extra, top="2", env=None):
    return forge(tmp_path, *args_with(["sweep", "--round", "final", "--tiers", "4-8K", "--model", str(model), "--vllm",
                                       FAKE, "--client", BENCH, "--port", str(free_port()), "--num-prompts", "2",
                                       "--timeout", "30", "--top", top, "--tier-env", str(tmp_path / "tier-env.json")],
                                      extra), timeout=300,
                 **{"CUDA_VISIBLE_DEVICES": "0,1", "FAKE_TTFT_MS": "400", "FAKE_TOKEN_MS": "2", **(env or {})})


def _formula(tok, base, weight=20):
    return weight * (0.6 + 0.4 * (1 - math.exp(-1.3 * (tok / base - 1))))


# 8 ms a token: the fake server's per-token cost of its own (the HTTP stream, the client, 0.5-2.5 ms on a busy
# 2-core machine) then moves a TPOT by less than the SLA's 1.5x, so a candidate measured like the baseline
# stays within it (at 2 ms, a loaded machine pushed one to 1.8x and the sweep recorded no winner)
STEADY = {"FAKE_TOKEN_MS": "8"}


def test_sweep_final_end_to_end_then_resume(tmp_path, model):
    r = _sweep(tmp_path, model, "--baseline-profile", "upstream", *SPACE, env=STEADY)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    sweeps = list((tmp_path / "sweeps").iterdir())
    assert len(sweeps) == 1
    sweep_id = sweeps[0].name
    st = json.loads((sweeps[0] / "sweep.json").read_text())
    ranking = st["tiers"]["4-8K"]["ranking"]
    assert st["harness"] is False and "harness_server_args" not in st
    assert st["space"] == {"topologies": ["tp1dp2", "tp2dp1"], "kv_dtypes": ["bf16", "int8"], "max_num_seqs": [64],
                           "max_num_batched_tokens": [4096], "gpu_memory_utilization": [0.95], "concurrency": [8]}
    covered = [k for x in ranking for k in (x["key"], *x["same_prediction"])]     # alike predictions: one served
    assert sorted(covered) == sorted(f"{t}-{k}-s64-b4096-u0.95-c8" for t in ("tp2dp1", "tp1dp2") for k in ("bf16", "int8"))
    assert len(ranking) >= 2
    runs = {d.name: d for d in (tmp_path / "runs").iterdir()}
    base = runs.pop(f"{sweep_id}-4-8K-baseline")
    assert sorted(runs) == sorted(f"{sweep_id}-4-8K-{x['key']}" for x in ranking[:2])   # the top two, each its own run
    base_log = (base / "server.log").read_text()
    assert "--tensor-parallel-size 2 --data-parallel-size 1 --max-num-seqs 128 --max-num-batched-tokens 4096" in base_log
    base_res = json.loads((base / "4-8K.json").read_text())
    measured = {}
    for x in ranking[:2]:
        d = runs[f"{sweep_id}-4-8K-{x['key']}"]
        c = x["candidate"]
        log = (d / "server.log").read_text()       # the server ran with the candidate's values
        assert (f"--tensor-parallel-size {c['tensor_parallel_size']} --data-parallel-size {c['data_parallel_size']} "
                "--max-num-seqs 64 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.95") in log
        assert ("--kv-cache-dtype int8" in log) == (c["kv_dtype"] == "int8")
        served = json.loads((d / "serve.json").read_text())
        assert not {"harness_args", "differences"} & set(served)
        assert served["settings"]["concurrency"] == 8, served["settings"]    # what the client ran, not the baseline's
        m = json.loads((d / "manifest.json").read_text())
        assert m["round"] == "final" and m["client_settings"]["tiers"]["4-8K"]["max_concurrency"] == 8
        assert "--max-concurrency 8 --request-rate inf" in m["client_commands"]["4-8K"]
        res = json.loads((d / "4-8K.json").read_text())
        ts = json.loads((d / "tier-score.json").read_text())
        assert ts["formula_score"] == pytest.approx(_formula(res["output_throughput"], base_res["output_throughput"]))
        assert ts["ttft_p99_limit_ms"] == pytest.approx(1.5 * base_res["p99_ttft_ms"])
        within = res["p99_ttft_ms"] <= 1.5 * base_res["p99_ttft_ms"] and res["p99_tpot_ms"] <= 1.5 * base_res["p99_tpot_ms"]
        assert ts["contribution"] == (ts["formula_score"] if within else 0.0)
        measured[x["key"]] = (res["output_throughput"] if within else -1.0, c)
    assert not health(8001)
    env = json.loads((tmp_path / "tier-env.json").read_text())
    best = max(measured, key=lambda k: measured[k][0])
    assert measured[best][0] > 0, "no configuration within the SLA: the fake server's timing is too noisy"
    win = env["tiers"]["4-8K"]
    c = measured[best][1]
    assert env["round"] == "final" and win["sweep"] == sweep_id and win["run"] == f"{sweep_id}-4-8K-{best}"
    assert win["environment"] == {"TENSOR_PARALLEL_SIZE": str(c["tensor_parallel_size"]),
                                  "DATA_PARALLEL_SIZE": str(c["data_parallel_size"]), "MAX_NUM_SEQS": "64",
                                  "MAX_NUM_BATCHED_TOKENS": "4096", "GPU_MEMORY_UTILIZATION": "0.95",
                                  "CONCURRENCY_4_8K": "8"}
    assert win["engine_options"] == ({"--kv-cache-dtype": "int8"} if c["kv_dtype"] == "int8" else {})
    assert best in r.stdout and "winner" in r.stdout

    # an interrupted sweep: the second configuration's measurement is lost; a resume runs it alone
    second = runs[f"{sweep_id}-4-8K-{ranking[1]['key']}"]
    for f in ("tier-score.json", "4-8K.json"):
        (second / f).unlink()
    first_result = (runs[f"{sweep_id}-4-8K-{ranking[0]['key']}"] / "4-8K.json").read_bytes()
    r = _sweep(tmp_path, model, "--baseline-profile", "upstream", *SPACE, "--sweep-id", sweep_id, env=STEADY)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "already measured" in out and out.count("server ready") == 1, out
    assert (runs[f"{sweep_id}-4-8K-{ranking[0]['key']}"] / "4-8K.json").read_bytes() == first_result
    assert (second / "tier-score.json").is_file()

    # a resume with another space is refused; another sweep may not replace the winner without --force
    r = _sweep(tmp_path, model, "--baseline-profile", "upstream", *SPACE[:-1], "10", "--sweep-id", sweep_id)
    assert r.returncode == 2 and "another space" in r.stderr and "--concurrency 8 in its record, 10 now" in r.stderr
    before = (tmp_path / "tier-env.json").read_bytes()
    r = _sweep(tmp_path, model, "--baseline", str(base), *SPACE, top="1")
    assert r.returncode == 2 and "already holds a recorded winner" in r.stderr and "--force" in r.stderr
    assert (tmp_path / "tier-env.json").read_bytes() == before
    assert len(list((tmp_path / "sweeps").iterdir())) == 1            # refused before anything was written
    r = _sweep(tmp_path, model, "--baseline", str(base), *SPACE, "--force", top="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "tier-env.json").read_text())["tiers"]["4-8K"]["sweep"] != sweep_id


def test_configurations_differing_only_in_concurrency_share_one_server(tmp_path, model):
    """Configurations of two servers (TP2, bf16, 64 / 0.95, at 2048 and at 4096 batched tokens), each at
    concurrency 6 and 8: those of one server run one after the other on one server start, the later one taking it
    over (its serve.json names the run that started it, with its own concurrency, and its client ran that
    concurrency); every server is stopped at the end."""
    space = ["--topologies", "tp2", "--kv-dtypes", "bf16", "--max-num-seqs", "64", "--max-num-batched-tokens",
             "2048,4096", "--gpu-memory-utilization", "0.95", "--concurrency", "6,8"]
    r = _sweep(tmp_path, model, "--baseline-profile", "upstream", *space, top="4", env=STEADY)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    sweep_id = next((tmp_path / "sweeps").iterdir()).name
    ranking = json.loads((tmp_path / "sweeps" / sweep_id / "sweep.json").read_text())["tiers"]["4-8K"]["ranking"][:4]
    groups: dict = {}
    for x in ranking:
        groups.setdefault(x["candidate"]["max_num_batched_tokens"], []).append(x)
    shared = [g for g in groups.values() if len(g) == 2]
    assert shared, [x["key"] for x in ranking]          # alike predictions are served once: at least one pair left
    for g in shared:
        recs = {x["key"]: json.loads((tmp_path / "runs" / f"{sweep_id}-4-8K-{x['key']}" / "serve.json").read_text())
                for x in g}
        (starter, a), (taker, b) = sorted(recs.items(), key=lambda kv: "server_of_run" in kv[1])
        assert "server_of_run" not in a and b["server_of_run"] == f"{sweep_id}-4-8K-{starter}", recs
        assert not (tmp_path / "runs" / f"{sweep_id}-4-8K-{taker}" / "server.log").exists()
        conc = next(x["candidate"]["concurrency"] for x in g if x["key"] == taker)
        assert b["settings"]["concurrency"] == conc != a["settings"]["concurrency"]
        m = json.loads((tmp_path / "runs" / f"{sweep_id}-4-8K-{taker}" / "manifest.json").read_text())
        assert m["client_settings"]["tiers"]["4-8K"]["max_concurrency"] == conc
        assert (tmp_path / "runs" / f"{sweep_id}-4-8K-{taker}" / "tier-score.json").is_file()
    assert out.count("server ready") == 1 + len(groups), out          # the baseline's, then one per server
    assert out.count("kept, not restarted") == len(shared) and not health(8001)


def test_one_servers_configurations_are_ordered_together_and_only_the_kept_server_is_taken_over(tmp_path):
    """grouped: the best-ranked configuration first, then the rest of its server's, then the next server's; adopt
    takes over nothing where no server is up, or where the one up is not the run the sweep kept."""
    from forge.run import final_serve

    def entry(b, c):
        return {"key": f"b{b}-c{c}", "candidate": {"tensor_parallel_size": 2, "data_parallel_size": 1, "kv_dtype": "bf16",
                                                   "max_num_seqs": 64, "max_num_batched_tokens": b,
                                                   "gpu_memory_utilization": 0.95, "concurrency": c, "planned": c == 8}}
    ranked = [entry(4096, 8), entry(2048, 8), entry(4096, 6), entry(2048, 10), entry(4096, 10)]
    assert [(i, r["key"]) for i, r in final_serve.grouped(ranked)] == [
        (1, "b4096-c8"), (3, "b4096-c6"), (5, "b4096-c10"), (2, "b2048-c8"), (4, "b2048-c10")]
    assert final_serve.server_key(ranked[0]["candidate"]) == final_serve.server_key(ranked[2]["candidate"])
    assert not final_serve.adopt(tmp_path / "p.yaml", "4-8K", "r2", "r1", {"model": str(tmp_path)}, rules.load_contest())


@pytest.mark.parametrize("args,needle", [
    (["--concurrency", "0"], "concurrency 0 is out of bounds"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0 is out of bounds"),
    (["--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization 1.2 is out of bounds"),
    (["--topologies", "tp3"], "'tp3' is not a topology"),
    (["--kv-dtypes", "fp8"], "'fp8' is not a KV dtype"),
    (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"], "the search space is empty"),
    (["--top", "0"], "--top 0"),
    (["--tiers", "2-4K"], "not a tier of the final round"),
    ([], "give --baseline RUN"),
    (["upstream"], "profiles given"),
])
def test_bad_input_is_refused_before_anything_runs(tmp_path, model, args, needle):
    extra = args if (args == [] or "--baseline" in args) else [*args, "--baseline-profile", "upstream"]
    if args == ["upstream"]:
        r = forge(tmp_path, "sweep", "upstream", "--round", "final", "--model", str(model), "--baseline-profile", "upstream")
    else:
        r = _sweep(tmp_path, model, *extra)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "sweeps").exists()


@pytest.mark.parametrize("var", ["MAX_NUM_SEQS_4_8K", "CONCURRENCY_4_8K"])
def test_a_start_script_variable_in_the_environment_is_refused(tmp_path, model, var):
    r = _sweep(tmp_path, model, "--baseline-profile", "upstream", *SPACE, env={var: "12"})
    assert r.returncode == 2 and f"{var} is set" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


def test_the_model_ranks_every_candidate_once_and_a_bad_ranking_is_refused():
    c = rules.load_contest()
    rnd = rounds.load_round(c, "final")
    cands = final_space.space(rnd, max_num_seqs="32,128", max_num_batched_tokens="4096",
                              gpu_memory_utilization="0.95", concurrency="10")
    assert len(cands) == 2 * 2 * 2
    from forge.run import final_sweep
    ranked = final_space.rank(final_sweep.model_ranker(c, rnd), "16-32K", cands)
    assert sorted(r.candidate.key for r in ranked) == sorted(x.key for x in cands)
    assert all("tok_s" in r.predicted for r in ranked)
    with pytest.raises(ForgeError, match="not one of the candidates"):
        final_space.rank(lambda tier, cs: [final_space.Ranked(cs[0]), final_space.Ranked(cs[0])], "4-8K", cands)


def test_the_preliminary_has_no_search_space():
    rnd = rounds.load_round(rules.load_contest(), "preliminary")
    with pytest.raises(ForgeError, match="unlocks nothing"):
        final_space.space(rnd)


def _tier_env_file(path):
    env = {"TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2", "MAX_NUM_SEQS": "32",
           "MAX_NUM_BATCHED_TOKENS": "8192", "GPU_MEMORY_UTILIZATION": "0.9", "CONCURRENCY_8_16K": "12"}
    path.write_text(json.dumps({"round": "final", "tiers": {"8-16K": {
        "environment": env, "engine_options": {"--kv-cache-dtype": "int8"}, "kv_dtype": "int8", "run": "r-8-16K",
        "sweep": "s1", "tok_s": 120.5, "lift": 0.25, "score": 40.0}}}))
    return env


def test_report_final_lists_the_environment_per_tier(tmp_path):
    env = _tier_env_file(tmp_path / "te.json")
    r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(tmp_path / "te.json"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    doc = (tmp_path / "out" / "submission" / "ENVIRONMENT.md").read_text()
    section = doc[doc.index("## The final round: the environment per tier"):]
    assert " ".join(f"{k}={v}" for k, v in env.items()) in section              # the sweep's winner for 8-16K
    assert "`--kv-cache-dtype int8`" in section and "sweep s1, run r-8-16K" in section
    for tier in ("4-8K", "16-32K"):                                           # no winner: the finals' baseline
        suffix = tier.replace("-", "_")
        assert (f"TENSOR_PARALLEL_SIZE=2 DATA_PARALLEL_SIZE=1 MAX_NUM_SEQS=128 MAX_NUM_BATCHED_TOKENS=4096 "
                f"GPU_MEMORY_UTILIZATION=0.95 CONCURRENCY_{suffix}=10") in section
    pre = forge(tmp_path, "report", "--out", str(tmp_path / "pre"))
    assert pre.returncode == 0, pre.stderr
    assert "## The final round" not in (tmp_path / "pre" / "submission" / "ENVIRONMENT.md").read_text()


@pytest.mark.parametrize("args,needle", [(["--tier-env", "TE"], "goes with --round final"),
                                         (["--round", "final", "--tier-env", "BAD"], "not a tier-environment file"),
                                         (["--round", "semifinal"], "not a round")])
def test_report_refuses_a_wrong_tier_env_before_writing(tmp_path, args, needle):
    _tier_env_file(tmp_path / "te.json")
    (tmp_path / "bad.json").write_text('{"tiers": {"4-8K": {"environment": {"X": 1}}}}')
    args = [{"TE": str(tmp_path / "te.json"), "BAD": str(tmp_path / "bad.json")}.get(a, a) for a in args]
    r = forge(tmp_path, "report", *args, "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_winner_of_a_harness_sweep_is_not_shipped(tmp_path):
    """A tier-environment file whose winner a harness sweep measured (random weights on a GPU machine, end-of-text
    ignored) ranks the GPU machine's stand-in, not the card: the submission's documents refuse it, naming the
    file and the tier, and write nothing (before, it went into ENVIRONMENT.md as a sweep winner)."""
    _tier_env_file(tmp_path / "te.json")
    d = json.loads((tmp_path / "te.json").read_text())
    d["tiers"]["8-16K"]["harness"] = True
    (tmp_path / "te.json").write_text(json.dumps(d))
    r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(tmp_path / "te.json"), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "key 'tiers.8-16K'" in r.stderr and "harness sweep" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_the_winner_records_how_it_was_measured():
    from forge.run import final_pick
    rnd = rounds.load_round(rules.load_contest(), "final")
    cand = final_space.space(rnd, topologies="dp2", kv_dtypes="bf16", max_num_seqs="32", max_num_batched_tokens="4096",
                             gpu_memory_utilization="0.95", concurrency="10")[0]
    res = {"tok_s": 100.0, "lift": 0.1, "contribution": 30.0, "baseline": "b"}
    assert final_pick.entry(rnd, "4-8K", cand, "r", "s", {**res, "harness": True}, "p")["harness"] is True
    assert final_pick.entry(rnd, "4-8K", cand, "r", "s", res, "p")["harness"] is False


def test_the_submissions_documents_carry_the_final_section():
    from forge.ship import contest_docs
    c = rules.load_contest()
    pre = contest_docs.documents(c, "forge submission")["ENVIRONMENT.md"]
    fin = contest_docs.documents(c, "forge submission", round_name="final")["ENVIRONMENT.md"]
    assert fin.startswith(pre) and "## The final round: the environment per tier" in fin[len(pre):]
    assert "CONCURRENCY_16_32K=10" in fin and "## The final round" not in pre


def test_the_preliminary_sweep_refuses_the_final_rounds_options(tmp_path, model):
    r = forge(tmp_path, "sweep", "upstream", "--model", str(model), "--baseline", "x", "--concurrency", "8")
    assert r.returncode == 2 and "--baseline, --concurrency: the final round's search options" in r.stderr
    r = forge(tmp_path, "sweep", "upstream", "--model", str(model), "--kv-cache-memory-bytes", "7501512704")
    assert r.returncode == 2 and "--kv-cache-memory-bytes: the final round's search options" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_candidates_the_model_cannot_tell_apart_are_served_once():
    rnd = rounds.load_round(rules.load_contest(), "final")
    cands = final_space.space(rnd, topologies="tp2", kv_dtypes="bf16", max_num_seqs="16,32",
                              max_num_batched_tokens="4096", gpu_memory_utilization="0.95", concurrency="8,10")
    pred = {c.key: {"tok_s": float(c.concurrency)} for c in cands}           # alike whatever --max-num-seqs
    ranked = [final_space.Ranked(c, pred[c.key]) for c in sorted(cands, key=lambda c: -c.concurrency)]
    out, same = final_space.distinct(ranked)
    assert [r.candidate.concurrency for r in out] == [10, 8]
    assert all(len(same[r.candidate.key]) == 1 for r in out)
    assert final_space.distinct([final_space.Ranked(c) for c in cands])[0] == [final_space.Ranked(c) for c in cands]


def _installed_site(tmp_path) -> Path:
    """A bundle of one small wheel, installed as a GPU machine installs it: `forge e2e-gpu --install-only`."""
    b = probe_bundle(tmp_path)
    site = tmp_path / "site"
    r = forge(tmp_path, "e2e-gpu", "--install-only", "--bundle", str(b), "--site", str(site))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["site", str(site), "model", str(b / "model")]
    assert (site / "forgeprobe" / "__init__.py").is_file() and not (tmp_path / "runs").exists()
    r = forge(tmp_path, "e2e-gpu", "--install-only", "--bundle", "", "--site", str(site))
    assert r.returncode == 2 and "--install-only" in r.stderr and "Traceback" not in r.stderr
    return site


def test_a_harness_sweep_serves_with_the_harness_args_and_the_installed_site(tmp_path, model):
    site = _installed_site(tmp_path)
    kv = ["--kv-cache-memory-bytes", "7501512704", "--kv-why", "a DCU card's KV cache at TP2"]
    r = _sweep(tmp_path, model, "--harness", "--site", str(site), *kv, "--baseline-profile", "upstream", *SPACE,
               top="1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "the same KV cache per GPU" in r.stderr        # tp2 and dp2 in the space: one size for both
    h = gpu_harness.harness_config()
    want = [*h["server_args"], {"args": kv[:2], "why": kv[3]}]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    for d in runs:                                        # the baseline's server and the configuration's alike
        m = json.loads((d / "manifest.json").read_text())
        assert m["harness"] is True and "--ignore-eos" in m["client_commands"]["4-8K"]
        srv = json.loads((d / "serve.json").read_text())
        assert srv["harness_args"] == [x for c in want for x in c["args"]]
        assert srv["differences"] == [{"side": "server", **c} for c in want]
        assert srv["scored_port"] is False
        log = (d / "server.log").read_text()              # the server received them, and the site first
        assert all(repr(x) in log for x in srv["harness_args"])
        assert f"PYTHONPATH={site.resolve()}" in log
    st = json.loads(next((tmp_path / "sweeps").iterdir()).joinpath("sweep.json").read_text())
    assert st["harness_server_args"] == [x for c in want for x in c["args"]]
    measured = next(d for d in runs if not d.name.endswith("-baseline"))
    assert (measured / "tier-score.json").is_file()
    base = next(d for d in runs if d.name.endswith("-baseline"))
    r = _sweep(tmp_path, model, "--baseline", str(base), *SPACE, "--force", "--tier-env", str(tmp_path / "other.json"),
               top="1")
    assert r.returncode == 2 and "harness run" in r.stderr and len(list((tmp_path / "runs").iterdir())) == 2


@pytest.mark.parametrize("args,needle", [
    (["--kv-cache-memory-bytes", "7501512704"], "--kv-cache-memory-bytes: the options of a harness sweep's servers"),
    (["--kv-why", "a DCU card's"], "--kv-why: the options of a harness sweep's servers"),
    (["--site", "/tmp"], "--site: the options of a harness sweep's servers"),
    (["--harness", "--site", "SITE"], "no GPU bundle is installed there"),
    (["--harness", "--site", "SITE", "--kv-cache-memory-bytes", "1000"], "under 256 MiB"),
    (["--harness", "--site", "SITE", "--kv-why", "x"], "--kv-why: it records why"),
    (["--harness", "--site", "SITE", "--image", "forge:1"], "not in a container"),
])
def test_the_harness_servers_options_are_checked_before_anything_is_written(tmp_path, model, args, needle):
    r = _sweep(tmp_path, model, *[str(tmp_path) if a == "SITE" else a for a in args], "--baseline-profile",
               "upstream", *SPACE)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "sweeps").exists()
    assert not (tmp_path / "tier-env.json").exists()


def test_the_search_tries_the_planners_max_num_seqs_per_tier():
    """Per tier, beside each point whose concurrency would preempt, the candidate at the capacity
    planner's max-num-seqs (forge plan's planned seqs): 16-32K on DP2 bf16 sends 5 requests to a card
    whose cache holds 4 of the tier's largest; 4-8K needs no cap. The model ranks it like the others; its
    key is the server's values (a checked name); the winner's environment carries the number."""
    c = rules.load_contest()
    rnd = rounds.load_round(c, "final")
    from forge.run import final_pick, final_sweep
    cands = final_space.space(rnd, max_num_seqs="32,128", max_num_batched_tokens="4096",
                              gpu_memory_utilization="0.95", concurrency="10")
    long = final_space.with_planned(rnd, cands, final_sweep.model_planner(c, rnd, "16-32K"))
    assert long[:len(cands)] == cands
    (capped,) = long[len(cands):]
    assert capped.key == "tp1dp2-bf16-s4-b4096-u0.95-c10" and capped.planned
    assert capped.label == capped.key + " (planned)"
    assert final_space.Candidate(**capped.as_dict()) == capped                       # the sweep record's round trip
    assert final_space.with_planned(rnd, cands, final_sweep.model_planner(c, rnd, "4-8K")) == cands
    ranked = final_space.rank(final_sweep.model_ranker(c, rnd), "16-32K", long)
    pred = {r.candidate: r.predicted for r in ranked}
    assert pred[capped]["preemptions"] == 0 and pred[capped]["tok_s"] > 0
    # a value the space holds already is the same configuration (one key, one run folder), marked planned
    given = final_space.space(rnd, topologies="dp2", kv_dtypes="bf16", max_num_seqs="4,128",
                              max_num_batched_tokens="4096", gpu_memory_utilization="0.95", concurrency="10")
    marked = final_space.with_planned(rnd, given, final_sweep.model_planner(c, rnd, "16-32K"))
    assert [(x.key, x.planned) for x in marked] == [(capped.key, True), ("tp1dp2-bf16-s128-b4096-u0.95-c10", False)]
    res = {"tok_s": 30.0, "lift": 0.2, "contribution": 50.0, "baseline": "base-run"}
    e = final_pick.entry(rnd, "16-32K", capped, "run-1", "sweep-1", res, "contest + " + capped.key)
    assert e["environment"]["MAX_NUM_SEQS"] == "4" and e["max_num_seqs_planned"] is True
    assert e["environment"]["CONCURRENCY_16_32K"] == "10"


def test_a_sweep_serves_the_planned_candidate_and_its_winner_carries_the_number(tmp_path, model):
    """16-32K on DP2 bf16 at concurrency 10: the space holds max-num-seqs 64 alone; the sweep adds the
    planner's 4, the model ranks it first (no preemption), it is served with --max-num-seqs 4 in its own
    run folder, labelled planned in the record, its winner's environment says MAX_NUM_SEQS=4 for the
    tier, and a resume finds the same run."""
    args = ["sweep", "--round", "final", "--tiers", "16-32K", "--model", str(model), "--vllm", FAKE, "--client", BENCH,
            "--port", str(free_port()), "--num-prompts", "2", "--timeout", "30", "--top", "1",
            "--tier-env", str(tmp_path / "tier-env.json"), "--baseline-profile", "upstream", "--topologies", "dp2",
            "--kv-dtypes", "bf16", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
            "--gpu-memory-utilization", "0.95", "--concurrency", "10"]
    # a first token at 400 ms: a stall of the loaded CI machine (100-200 ms) does not put one server's TTFT
    # P99 of two requests over 1.5x the other's, which would leave the tier without a winner
    env = dict(CUDA_VISIBLE_DEVICES="0,1", FAKE_TTFT_MS="400", FAKE_TOKEN_MS="2")
    r = forge(tmp_path, *args, timeout=300, **env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (sdir,) = (tmp_path / "sweeps").iterdir()
    ranking = json.loads((sdir / "sweep.json").read_text())["tiers"]["16-32K"]["ranking"]
    key = "tp1dp2-bf16-s4-b4096-u0.95-c10"
    assert [x["key"] for x in ranking] == [key, "tp1dp2-bf16-s64-b4096-u0.95-c10"]
    assert ranking[0]["candidate"]["planned"] is True and ranking[0]["label"] == key + " (planned)"
    assert ranking[0]["predicted"]["preemptions"] == 0 < ranking[1]["predicted"]["preemptions"]
    run = tmp_path / "runs" / f"{sdir.name}-16-32K-{key}"
    assert "--data-parallel-size 2 --max-num-seqs 4 --max-num-batched-tokens 4096" in (run / "server.log").read_text()
    assert f"{key} (planned)" in r.stdout
    assert (tmp_path / "tier-env.json").is_file(), "no winner was written:\n" + r.stdout[-2000:] + r.stderr[-2000:]
    win = json.loads((tmp_path / "tier-env.json").read_text())["tiers"]["16-32K"]
    assert win["run"] == run.name and win["max_num_seqs_planned"] is True
    assert win["environment"]["MAX_NUM_SEQS"] == "4" and win["environment"]["CONCURRENCY_16_32K"] == "10"
    r = forge(tmp_path, *args, "--sweep-id", sdir.name, timeout=300, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already measured in run " + run.name in r.stdout + r.stderr
    assert sorted(d.name for d in (tmp_path / "runs").iterdir()) == sorted([f"{sdir.name}-16-32K-baseline", run.name])


def test_a_sweep_on_a_machine_without_the_cards_is_refused_before_it_writes_anything(tmp_path, model):
    # one visible card: every final-round start needs two, so the first server would refuse; the sweep
    # refuses first, before its ranking or any folder is written (a rerun on the right machine starts clean)
    r = forge(tmp_path, "sweep", "--round", "final", "--tiers", "4-8K", "--model", str(model), "--vllm", FAKE,
              "--client", BENCH, "--num-prompts", "2", "--baseline-profile", "upstream",
              "--tier-env", str(tmp_path / "tier-env.json"), *SPACE, CUDA_VISIBLE_DEVICES="0")
    assert r.returncode == 2 and "needs 2 cards, 1 visible (CUDA_VISIBLE_DEVICES=0)" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "sweeps").exists()
    assert not (tmp_path / "tier-env.json").exists()
    r = forge(tmp_path, "sweep", "--round", "final", "--tiers", "4-8K", "--model", str(model), "--vllm", FAKE,
              "--client", BENCH, "--num-prompts", "2", "--baseline-profile", "upstream",
              "--tier-env", str(tmp_path / "tier-env.json"), *SPACE, CUDA_VISIBLE_DEVICES="3,3")
    assert r.returncode == 2 and "two ranks on device 3" in r.stderr, r.stderr[-2000:]


def test_a_served_configuration_the_model_says_would_not_run_is_said(tmp_path, model):
    """A narrow space (TP2 above 0.95, which the finals' model does not take) leaves the sweep nothing it predicts
    to run: it serves the best of them all the same (the card is the test), and says so."""
    r = _sweep(tmp_path, model, "--baseline-profile", "upstream", "--topologies", "tp2", "--kv-dtypes", "bf16",
               "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.97",
               "--concurrency", "8", top="1", env=STEADY)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "tp2dp1-bf16-s64-b4096-u0.97-c8: the model predicts it would not run" in r.stderr, r.stderr[-3000:]
    assert "only TP1 is modelled" in r.stderr
