"""`forge plan --against RUN`: the capacity planner against the KV cache a served run's vLLM reported,
on real recorded reports (the H200 servers of reports/plan/2026-12-04-h200-kv-check and the e2e run of
reports/e2e/2026-12-06-h200-final-4-8k-uncapped) and on made-up ones that must fail the check."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

from helpers import ROOT, SUPPORT, forge, forge_env, free_port, tiny_model
from test_final_round_serve import clean_env

from forge import tarsafe

KV_LOGS = ROOT / "reports" / "plan" / "2026-12-04-h200-kv-check"
E2E = ROOT / "reports" / "e2e" / "2026-12-06-h200-final-4-8k-uncapped" / "raw.tgz"
START = ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/models/qwen", "--served-model-name", "Qwen3.5-27B",
         "--port", "8001", "--max-num-seqs", "128", "--max-num-batched-tokens", "4096"]


def run_folder(tmp_path, name, argv, kv_cache=None, log=None):
    d = tmp_path / name
    d.mkdir()
    rec = {"profile": "contest", "launch": argv}
    if kv_cache is not None:
        rec["kv_cache"] = kv_cache
    (d / "serve.json").write_text(json.dumps(rec))
    if log is not None:
        (d / "server.log").write_text(log)
    return d


def test_the_recorded_h200_servers_pass_on_their_card_and_fail_on_the_dcus(tmp_path):
    """The servers that gave the planner's H200 points, as run folders (their command, their log's lines):
    within 2 % on --card h200 (0.95 bf16 is +0.24 %, int8 0.0 %); priced as a DCU card they are far off,
    and the check fails with exit 1 naming the card."""
    for dtype, name in (("bf16", "kv-0.95-bf16.log"), ("int8", "kv-0.95-int8.log")):
        argv = START + ["--gpu-memory-utilization", "0.95"] + (["--kv-cache-dtype", "int8"] if dtype == "int8" else [])
        d = run_folder(tmp_path, dtype, argv, log=(KV_LOGS / name).read_text())
        r = forge(tmp_path, "plan", "--against", str(d), "--card", "h200", "--out", str(tmp_path / f"out-{dtype}"))
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads((tmp_path / f"out-{dtype}" / "plan-check.json").read_text())
        assert res["config"]["kv_dtype"] == dtype and res["ok"]
        rank = res["ranks"][0]
        measured = int(next(x for x in (KV_LOGS / name).read_text().splitlines() if "GPU KV cache size" in x)
                       .split("size:")[1].split()[0].replace(",", ""))
        assert rank["reported_tokens"] == measured and abs(rank["error"]) <= 0.02
        r = forge(tmp_path, "plan", "--against", str(d))
        assert r.returncode == 1 and "NO" in r.stdout and "--card dcu" in r.stdout, r.stdout + r.stderr


def test_an_e2e_profile_folder_with_a_fixed_cache_checks_the_page_math(tmp_path):
    """The recorded e2e run's contest server, given a DCU card's bytes, reported 28,224 tokens: its log is in
    the run's logs/ folder, its serve.json has no report of its own."""
    with tarfile.open(E2E) as t:
        tarsafe.extract_tar(t, tmp_path / "e2e")
    r = forge(tmp_path, "plan", "--against", str(tmp_path / "e2e" / "runs" / "contest"))
    assert r.returncode == 0, r.stdout + r.stderr
    # given relative to the profile folder itself: the run's logs/ are still found
    rel = subprocess.run([sys.executable, "-m", "forge", "plan", "--against", "."], cwd=tmp_path / "e2e" / "runs" /
                         "contest", env=forge_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert rel.returncode == 0 and "server-contest.log" in rel.stdout, rel.stdout + rel.stderr
    assert "--kv-cache-memory-bytes 7501512704 (fixed" in r.stdout and "server-contest.log" in r.stdout
    row = next(x.split() for x in r.stdout.splitlines() if x.strip().startswith("DP0"))
    assert row[1:4] == ["28,224", "28,224", "+0.00%"] and row[-1] == "yes", r.stdout


def test_each_rank_is_checked_and_unequal_ranks_are_flagged(tmp_path):
    """DP2 on the DCU at 0.95: the planner says 28,224 per replica; a rank that reported 24,304 (the public
    cold start) is 16 % off: exit 1, the rank named, the flag printed. TP2 at 0.95: the public 268,128."""
    flag = "unequal KV caches across data-parallel ranks (DP0 28,224, DP1 24,304 tokens)"
    d = run_folder(tmp_path, "dp2", START + ["--data-parallel-size", "2", "--gpu-memory-utilization", "0.95"],
                   kv_cache={"tokens": {"0": 28224, "1": 24304}, "equal": False, "flag": flag})
    r = forge(tmp_path, "plan", "--against", str(d))
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {x.split()[0]: x.split() for x in r.stdout.splitlines() if x.strip().startswith("DP")}
    assert rows["DP0"][-1] == "yes" and rows["DP1"][-1] == "NO" and flag in r.stdout
    d = run_folder(tmp_path, "tp2", START + ["--tensor_parallel_size=2", "--gpu-memory-utilization", "0.95"],
                   kv_cache={"tokens": {"0": 268128}, "equal": True, "flag": None})
    r = forge(tmp_path, "plan", "--against", str(d))          # vLLM's parser takes the underscore spelling too
    assert r.returncode == 0 and "TP2/DP1 bf16" in r.stdout, r.stdout + r.stderr
    # a DP2 command of which one rank reported: the other is not checked, so the check fails
    d = run_folder(tmp_path, "dp2one", START + ["-dp", "2", "--gpu-memory-utilization", "0.95"],
                   log="(EngineCore_DP0 pid=1) INFO GPU KV cache size: 28,224 tokens\n")
    r = forge(tmp_path, "plan", "--against", str(d))
    assert r.returncode == 1 and "(no report)" in r.stdout and "rank(s) 1 of the command's 2" in r.stdout, r.stdout
    assert "misses" not in r.stdout, r.stdout


def test_refusals_name_the_record_and_write_nothing(tmp_path):
    ok_cache = {"tokens": {"0": 28224}, "equal": True, "flag": None}
    cases = [
        (run_folder(tmp_path, "fp8", START + ["--kv-cache-dtype", "fp8"], kv_cache=ok_cache), [],
         "--kv-cache-dtype fp8"),
        (run_folder(tmp_path, "nombt", START[:-2], kv_cache=ok_cache), [], "sets no --max-num-batched-tokens"),
        (run_folder(tmp_path, "badtp", START + ["--tensor-parallel-size", "two"], kv_cache=ok_cache), [],
         "--tensor-parallel-size 'two'"),
        (run_folder(tmp_path, "util", START + ["--gpu-memory-utilization", "1.5"], kv_cache=ok_cache), [],
         "not in (0, 1]"),
        (run_folder(tmp_path, "noreport", START), [], "no KV cache report"),
        (run_folder(tmp_path, "flags", START, kv_cache=ok_cache), ["--kv-dtype", "int8"], "--kv-dtype"),
        (tmp_path / "missing", [], "not found"),
        (run_folder(tmp_path, "pp", START + ["-pp", "2"], kv_cache=ok_cache), [], "pipeline parallelism"),
        (run_folder(tmp_path, "dp1two", START, kv_cache={"tokens": {"0": 28224, "1": 28224}}), [],
         "rank(s) 1 reported a KV cache"),
        (run_folder(tmp_path, "zerolog", START, log="INFO GPU KV cache size: 0 tokens\n"), [], "0 tokens"),
        (run_folder(tmp_path, "badtokens", START, kv_cache={"tokens": {"0": "28,224"}}), [], "kv_cache.tokens"),
        (run_folder(tmp_path, "zerotokens", START, kv_cache={"tokens": {"0": 0}}), [], "kv_cache.tokens"),
        # a 30-digit count was printed as the rank's report
        (run_folder(tmp_path, "hugetokens", START, kv_cache={"tokens": {"0": 10 ** 30}}), [], "kv_cache.tokens"),
    ]
    (tmp_path / "nolaunch").mkdir()
    (tmp_path / "nolaunch" / "serve.json").write_text(json.dumps({"profile": "x"}))
    cases.append((tmp_path / "nolaunch", [], "no server command recorded"))
    (tmp_path / "noserve").mkdir()
    cases.append((tmp_path / "noserve", [], "no serve.json"))
    (tmp_path / "servedir" / "serve.json").mkdir(parents=True)      # said "no serve.json"
    cases.append((tmp_path / "servedir", [], "serve.json: not a file (a folder)"))
    for d, extra, msg in cases:
        r = forge(tmp_path, "plan", "--against", str(d), *extra, "--out", str(tmp_path / "o"))
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (d.name, r.stderr)
        assert not (tmp_path / "o").exists(), d.name
    # a recorded check is replaced only with --force; --out among the tool's sources is refused
    d = run_folder(tmp_path, "good", START + ["--gpu-memory-utilization", "0.95"], kv_cache=ok_cache)
    assert forge(tmp_path, "plan", "--against", str(d), "--out", str(tmp_path / "o")).returncode == 0
    r = forge(tmp_path, "plan", "--against", str(d), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--force" in r.stderr
    assert forge(tmp_path, "plan", "--against", str(d), "--out", str(tmp_path / "o"), "--force").returncode == 0
    r = forge(tmp_path, "plan", "--against", str(d), "--out", str(ROOT / "scripts" / "forge" / "plan-out"))
    assert r.returncode == 2 and not (ROOT / "scripts" / "forge" / "plan-out").exists(), r.stderr


def test_a_run_forge_serve_recorded_is_checked_rank_by_rank(tmp_path):
    """The record as `forge serve --round final` writes it (the final round's DP2 profile, a launcher that
    prints two ranks' KV lines before the fake server): given by its run id, each replica's report is
    priced as a DCU card's TP1 cache at the profile's utilization; equal ranks pass, a cold-start rank of
    24,304 tokens fails (exit 1) and the record's flag is printed."""
    model = tiny_model(tmp_path / "model")
    env = clean_env(tmp_path, HIP_VISIBLE_DEVICES="0,1")
    for rid, dp1 in (("even", "28,224"), ("cold", "24,304")):
        log = tmp_path / f"{rid}.txt"
        log.write_text("".join(f"(EngineCore_DP{r} pid=10{r}) INFO 12-04 17:00:40 [kv_cache_utils.py:1318] GPU KV "
                               f"cache size: {n} tokens\n" for r, n in ((0, "28,224"), (1, dp1))))
        launcher = tmp_path / f"{rid}.sh"
        launcher.write_text(f'#!/bin/sh\ncat {log}\nexec {sys.executable} {SUPPORT / "fakeserver.py"} "$@"\n')
        r = forge(tmp_path, "serve", "--round", "final", "--tier", "4-8K", "--profile", "final-dp2", "--model",
                  str(model), "--vllm", f"sh {launcher}", "--port", str(free_port()), "--run-id", rid, "--timeout",
                  "30", env=env)
        try:
            assert r.returncode == 0, r.stderr
        finally:
            forge(tmp_path, "stop", env=env)
        r = forge(tmp_path, "plan", "--against", rid, env=env)
        assert ("TP1/DP2 bf16" in r.stdout) and ("card dcu" in r.stdout), r.stdout + r.stderr
        rows = {x.split()[0]: x.split() for x in r.stdout.splitlines() if x.strip().startswith("DP")}
        assert rows["DP0"][1:3] == ["28,224", "28,224"], r.stdout
        if rid == "even":
            assert r.returncode == 0 and rows["DP1"][-1] == "yes", r.stdout
        else:
            assert r.returncode == 1 and rows["DP1"][-1] == "NO" and "unequal KV caches" in r.stdout, r.stdout
