"""The GPU end-to-end harness on a CPU box: the bundle's pieces (tokenizer, manifest), the server and
client commands against the organizers' (only the differences harness.yaml lists), the plumbing
comparison's verdicts, and whole `forge e2e-gpu` runs against two fake servers (the client replays
results recorded by vLLM's real client; tests/tree/test_gpu_harness.py runs the real client and the
fault check): one client invocation per (tier, profile), resuming a folder, reusing servers left up."""

import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, ROOT, SUPPORT, e2e_fake, forge_env, free_port_pair, h200_e2e, health  # noqa: E402

from forge.contest import rules as contest  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.lab import gpu_bundle, packing, plumbing, serverlog, tierguess, tiers  # noqa: E402

FAKE = f"{sys.executable} {SUPPORT / 'fakeserver.py'}"
REPLAY = f"{sys.executable} {SUPPORT / 'replayclient.py'}"


# --- bundle pieces ----------------------------------------------------------------------------------

def test_tokenizer_has_the_models_vocabulary_and_counts_words(tmp_path):
    from tokenizers import Tokenizer
    files = gpu_bundle.tokenizer_files(5003, 4001)
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 5003
    assert tok.token_to_id(gpu_bundle.EOS_TEXT) == 4001
    assert tok.id_to_token(4000) == "w4000" and tok.id_to_token(4002) == "w4002"
    text = "w17 w4000   w2\nw4998 w9"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == [17, 4000, 2, 4998, 9]
    assert tok.decode(ids) == "w17 w4000 w2 w4998 w9"
    # the organizers' parsers find their tokens; thinking off ends the prompt with an empty think block
    assert [tok.token_to_id(s) for s in gpu_bundle.SPECIAL_TEXTS] == [4999, 5000, 5001, 5002]
    from jinja2 import Template
    tmpl = Template(files["chat_template.jinja"])
    msgs = [{"role": "user", "content": "w5 w6"}]
    off = tmpl.render(messages=msgs, add_generation_prompt=True, enable_thinking=False)
    assert tok.encode(off, add_special_tokens=False).ids == [5, 6, 4999, 5000]
    assert tmpl.render(messages=msgs, add_generation_prompt=True) == "w5 w6"
    with pytest.raises(ForgeError):
        gpu_bundle.tokenizer_files(100, 100)
    with pytest.raises(ForgeError):
        gpu_bundle.tokenizer_files(100, 97)                  # among the special tokens' ids


def test_the_harness_client_has_every_token_decode_to_text(tmp_path):
    """vLLM's API primes each request's decode stream with the whole prompt; a token that decodes to nothing (a
    special one, skipped) keeps every id since the last text and decodes them all again at the next token. The
    random-weight model repeats one token, often a special one: the harness's client asks for the special tokens
    not to be skipped (harness.yaml), and then each of them comes out as text at its own step, as a real model's
    words do (harness/gpu/detok_cost.py times it with vLLM's own detokenizer)."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
    files = gpu_bundle.tokenizer_files(5003, 4001)
    (tmp_path / "tokenizer.json").write_text(files["tokenizer.json"])
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    body = next(json.loads(c["args"][1]) for c in gpu_bundle.harness_config()["client_args"]
                if c["args"][0] == "--extra-body")
    prompt = [17, 4000, 2, 4998, 9] * 40
    skipped = DecodeStream(ids=prompt, skip_special_tokens=True)
    assert [skipped.step(tok, 4001) for _ in range(5)] == [None] * 5         # nothing out: the prompt stays in
    assert skipped.step(tok, 17) is not None
    harness = DecodeStream(ids=prompt, skip_special_tokens=body.get("skip_special_tokens", True))
    out = [harness.step(tok, 4001) for _ in range(5)]
    assert all(t and gpu_bundle.EOS_TEXT in t for t in out), out
    assert body["temperature"] == 0.0                                         # the organizers' sampling kept


def test_bundle_manifest_catches_a_changed_or_missing_file(tmp_path):
    b = tmp_path / "bundle"
    (b / "wheels").mkdir(parents=True)
    (b / "wheels" / "a.whl").write_bytes(b"one")
    (b / "model").mkdir()
    (b / "model" / "config.json").write_text("{}")
    from forge.hashing import sha256_file
    files = {p.relative_to(b).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in b.rglob("*") if p.is_file()}
    (b / "manifest.json").write_text(json.dumps({"files": files, "vllm_wheel": "a.whl"}))
    assert gpu_bundle.verify_bundle(b)["vllm_wheel"] == "a.whl"
    (b / "wheels" / "a.whl").write_bytes(b"two")
    with pytest.raises(ForgeError, match=r"wheels/a.whl \(sha256 differs\)"):
        gpu_bundle.verify_bundle(b)
    (b / "model" / "config.json").unlink()
    with pytest.raises(ForgeError, match=r"model/config.json \(missing\)"):
        gpu_bundle.verify_bundle(b)


def test_harness_config_is_checked(tmp_path):
    h = gpu_bundle.harness_config()
    assert "upstream" in h["profiles"] and h["max_bundle_mib"] < 64
    bad = tmp_path / "h.yaml"
    bad.write_text((gpu_bundle.HARNESS / "harness.yaml").read_text().replace("pydantic==2.12.5", "pydantic>=2"))
    with pytest.raises(ForgeError, match=r"wheels.*not an exact pin"):
        gpu_bundle.harness_config(bad)


# (the commands against the organizers': test_e2e_commands.py)


# --- plumbing verdicts -----------------------------------------------------------------------------

def _out(tokens, first_top, lp=-12.4):
    return {"tokens": tokens, "token_logprobs": [lp] * len(tokens), "top": [first_top] + [{}] * (len(tokens) - 1)}


def test_plumbing_accepts_small_logprob_noise():
    top = {"w1": -12.40, "w2": -12.41, "w3": -12.42}
    ref = _out(["w1", "w5", "w9", "w2", "w7", "w8"], top)
    test = _out(["w1", "w5", "w9", "w3", "w3", "w3"], {k: v + 0.002 for k, v in top.items()})
    r = plumbing.compare_outputs(ref, test)
    assert r["gross"] == [] and r["same_prefix"] == 3 and r["first_token_same"]
    assert r["max_abs_logprob_diff"] == pytest.approx(0.002) and r["top_common"] == 3


@pytest.mark.parametrize("case,needle", [
    ("nan", "non-finite"), ("collapse", "repeated"), ("disjoint", "share nothing"), ("empty", "no tokens")])
def test_plumbing_flags_gross_mismatches(case, needle):
    top = {"w1": -12.40, "w2": -12.41}
    ref = _out(["w1", "w2", "w3", "w4", "w5", "w6"], top)
    test = {
        "nan": _out(["w1", "w2", "w3", "w4", "w5", "w6"], {"w1": math.nan, "w2": -12.41}, lp=math.nan),
        "collapse": _out(["w1"] * 6, top),
        "disjoint": _out(["w8", "w2", "w3", "w4", "w5", "w6"], {"w8": -12.4, "w9": -12.5}),
        "empty": {"tokens": [], "token_logprobs": [], "top": []},
    }[case]
    r = plumbing.compare_outputs(ref, test)
    assert any(needle in g for g in r["gross"]), r["gross"]


# --- whole runs against fake servers -------------------------------------------------------------

def _e2e(tmp_path, *extra, env_extra=None, timeout=300):
    """fast-int8's server (first port) replays the `fast` recording, upstream's the `base` one."""
    return e2e_fake(tmp_path, *extra, env_extra=env_extra, timeout=timeout)


def test_e2e_run_scores_every_profile_against_the_same_run_reference(tmp_path):
    r, port, out = _e2e(tmp_path, "--no-fault", "--server-args=--seed 7 --enforce-eager")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["profiles"] == ["fast-int8", "upstream"] and s["reference"] == "upstream"
    assert s["harness"]["server_args"][-3:] == ["--seed", "7", "--enforce-eager"]
    assert s["scores"]["upstream"]["display"] == "60.0"
    assert set(s["scores"]) == {"fast-int8", "upstream"}
    # fast-int8's proxy score is the contest formula, written out here, over what its server measured
    # (the replayed client files of tests/data/runs/fast) against what upstream's did (.../base);
    # every SLA holds for these files (test_score_formula.test_score_fast_against_base_run)
    expect = 0.0
    for t, w in (("4-8K", 20), ("8-16K", 50), ("16-32K", 30)):
        got, ref = (json.loads((FIXTURE_RUNS / d / f"{t}.json").read_text())["output_throughput"]
                    for d in ("fast", "base"))
        expect += w * (0.6 + 0.4 * (1 - math.exp(-1.3 * (got / ref - 1))))
    assert s["scores"]["fast-int8"]["total"] == pytest.approx(expect, rel=1e-6)
    assert s["scores"]["fast-int8"]["harness"] is True
    assert s["scores"]["fast-int8"]["display"] != "60.0"
    # the same report as `forge score --run ... --baseline ...`: output-length drift against the reference
    rec = json.loads((out / "runs" / "fast-int8" / "score.json").read_text())
    assert set(rec["output_drift"]) == {"4-8K", "8-16K", "16-32K"}
    assert "Output-length drift" in (out / "runs" / "fast-int8" / "score.md").read_text()
    assert json.loads((out / "runs" / "upstream" / "score.json").read_text())["output_drift"] is None
    # and the decode saving beside the kernel benchmark's prediction (fast-int8: our kernel, int8 KV)
    dec = json.loads((out / "decode.json").read_text())
    assert (dec["profiles"]["fast-int8"]["kv"], dec["profiles"]["fast-int8"]["kernel"]) == ("int8", "forge")
    assert dec["reference_kernel"] == "vllm_unified_3d"       # (the replayed rounds hold 4 requests: no rows)
    for t in ("4-8K", "8-16K", "16-32K"):
        got = json.loads((out / "runs" / "fast-int8" / f"{t}.json").read_text())
        rec = json.loads((FIXTURE_RUNS / "fast" / f"{t}.json").read_text())
        assert got["output_throughput"] == pytest.approx(rec["output_throughput"])
    assert s["plumbing"]["ok"] and len(s["plumbing"]["prompts"]) == len(plumbing.PLUMBING_PROMPT_TOKENS)
    # every (tier, profile) ran once, and each profile's server got its own profile's command
    calls = [json.loads(x) for x in (tmp_path / "replay.log").read_text().splitlines()]
    assert len(calls) == 6
    ports = {c["argv"][c["argv"].index("--port") + 1] for c in calls}
    assert ports == {str(port), str(port + 1)}
    for c in calls:
        a = c["argv"]
        assert a[a.index("--num-warmups") + 1] == "2" and a[a.index("--custom-output-len") + 1] == "-1"
        assert "--ignore-eos" in a and "--ready-check-timeout-sec" not in a
        # the contest workload's request: one line with its own output length
        line = json.loads(Path(a[a.index("--dataset-path") + 1]).read_text())
        tier = Path(a[a.index("--dataset-path") + 1]).stem
        assert [line["output_tokens"]] in [[o] for _, o in s["datasets"][tier]["requests"]]
    serve_int8 = json.loads((out / "runs" / "fast-int8" / "serve.json").read_text())
    assert "--kv-cache-dtype" in serve_int8["command"] and serve_int8["scored_port"] is False
    assert serve_int8["harness_args"][:4] == ["--load-format", "dummy", "--language-model-only", "--attention-backend"]
    up = json.loads((out / "runs" / "upstream" / "serve.json").read_text())
    assert up["env"]["VLLM_FORGE_DECODE"] == "0" and "--kv-cache-dtype" not in up["command"]
    md = (out / "summary.md").read_text()
    assert "| 16-32K |" in md and "Proxy score" in md and "contest workload" in md
    assert "TTFT share of wall time and ratios to upstream" in md and "DCU prediction from these ratios" in md
    assert "| 8-16K | upstream |" in md and "| 1.000 | 1.000 |" in md        # the reference against itself
    # the servers are gone and the pack holds the results without the datasets
    assert not health(port) and not health(port + 1)
    names = tarfile.open(tmp_path / "pack" / "e2e.tgz").getnames()
    assert "out/summary.md" in names and "out/runs/upstream/score.json" in names
    assert not any("/datasets/" in n for n in names) and not any(n.endswith("/server.log") for n in names)


def test_e2e_plumbing_failure_is_reported_and_fails_the_run(tmp_path):
    # the first profile's server answers with NaN logprobs; its port is the run's first port
    p = free_port_pair()
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(tmp_path / "replay.log"),
                    FAKE_GARBAGE_PORT=str(p))
    model = tmp_path / "model"
    gpu_bundle.write_model_dir(gpu_bundle.harness_config(), model)
    r = subprocess.run([sys.executable, "-m", "forge", "e2e-gpu", "--bundle", "", "--model", str(model),
                        "--vllm", FAKE, "--client", REPLAY, "--first-port", str(p), "--out", str(tmp_path / "out"),
                        "--num-prompts", "1", "--no-fault", "--tier-order", "4-8K", "--start-guess-s", "0"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert not s["plumbing"]["ok"] and "non-finite" in s["plumbing"]["verdict"]
    # only one tier ran: no proxy score, and the summary says why
    assert "scores" not in s or not s["scores"]
    assert "lacks a result" in s["score_note"]
    assert "Plumbing check" in (tmp_path / "out" / "summary.md").read_text()


def test_e2e_refuses_a_deadline_that_holds_no_tier_before_any_server_starts(tmp_path):
    """At --deadline-s 30 the servers' guessed start (--start-guess-s, 345 s by default) leaves no time
    for a tier: refused before anything starts; with no start counted, even the shortest tier's own
    guess (4-8K for both profiles) still does not fit."""
    for extra in (("--start-guess-s", "345"), ("--start-guess-s", "0")):
        r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--deadline-s", "30", "--reserve-s", "0", *extra)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "no tier would be measured" in r.stderr and "the shortest tier left, 4-8K, for fast-int8, upstream" \
            in r.stderr
        assert "--keep-servers" in r.stderr and "Traceback" not in r.stderr
        assert not health(port) and not (tmp_path / "replay.log").exists()      # nothing started, nothing run


@pytest.mark.parametrize("extra,words", [
    (("--deadline-s", "0"), "--deadline-s 0: seconds cannot be zero"),
    (("--reserve-s", "-1"), "--reserve-s -1: seconds cannot be negative"),
    (("--start-guess-s", "-5"), "--start-guess-s -5: seconds cannot be negative"),
    (("--bundle", "no-bundle"), "no-bundle: no manifest.json; not a GPU bundle"),
])
def test_e2e_refuses_bad_seconds_or_a_folder_that_is_no_bundle_before_writing_anything(tmp_path, extra, words):
    r, port, out = _e2e(tmp_path, "--no-fault", *extra)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not out.exists() and not health(port)


def test_e2e_deadline_leaves_tiers_out_and_says_so(tmp_path):
    """With --keep-servers the servers start all the same (for the next invocation), and every tier
    the deadline leaves out is named."""
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--deadline-s", "30", "--reserve-s", "0",
                        "--keep-servers")
    try:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "may measure no tier" in r.stderr and health(port)
        s = json.loads((out / "summary.json").read_text())
        assert s["skipped"] and all("left, needs" in x for x in s["skipped"])
        assert "Left out" in (out / "summary.md").read_text()
    finally:
        subprocess.run([sys.executable, "-m", "forge", "e2e-gpu", "--stop-servers", "--out", str(out)], cwd=ROOT,
                       env=forge_env(tmp_path), capture_output=True, timeout=120)
    assert not health(port)


def test_e2e_refuses_a_tier_or_profile_it_does_not_know_before_starting_anything(tmp_path):
    r, port, out = _e2e(tmp_path, "--no-fault", "--tier-order", "4-8k,16-32K")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "no tier named '4-8k'" in r.stderr and "4-8K, 8-16K, 16-32K" in r.stderr and "Traceback" not in r.stderr
    assert not health(port) and not (tmp_path / "replay.log").exists()     # nothing started, nothing run
    assert not out.exists()                                                # and no empty results folder
    r, port, out = _e2e(tmp_path, "--no-fault", "--profiles", "fast-int9,upstream")
    assert r.returncode == 2 and "profile 'fast-int9' not found" in r.stderr and "Traceback" not in r.stderr
    assert not health(port) and not (tmp_path / "replay.log").exists()
    assert not out.exists()


def test_e2e_resumes_its_folder_keeping_finished_tiers(tmp_path):
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    first = [json.loads(x)["tier"] for x in (tmp_path / "replay.log").read_text().splitlines()]
    assert first == ["4-8K", "4-8K"]
    # one tier gives no proxy score, but the decode comparison is still written
    assert not json.loads((out / "summary.json").read_text()).get("scores")
    assert json.loads((out / "decode.json").read_text())["profiles"]["fast-int8"]["kernel"] == "forge"
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    calls = [json.loads(x)["tier"] for x in (tmp_path / "replay.log").read_text().splitlines()]
    assert sorted(calls[2:]) == ["16-32K", "16-32K", "8-16K", "8-16K"]       # 4-8K was not run again
    s = json.loads((out / "summary.json").read_text())
    assert len(s["earlier_invocations"]) == 1
    assert any("kept from an earlier invocation" in x["step"] for x in s["steps"])
    assert s["scores"]["upstream"]["display"] == "60.0"
    # other prompts (another --num-prompts) cannot be mixed into the same folder
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--num-prompts", "2")
    assert r.returncode != 0 and "other prompts" in (r.stdout + r.stderr)


# --- parsers on the real run's files (reports/e2e/2026-11-30-h200: vLLM 0.18.1 patched, H200) -----
# copies of the recorded files (tests/data/h200-e2e.tgz, see tests/data/README.md)

H200 = h200_e2e()
REAL = H200 / "2026-11-30-h200"


def test_log_facts_read_the_real_server_logs():
    """Values as printed by the real servers (see the log lines quoted in reports/e2e/README.md)."""
    int8 = serverlog.log_facts(REAL / "logs" / "server-fast-int8.log")
    bf16 = serverlog.log_facts(REAL / "logs" / "server-upstream.log")
    assert (int8["attention_block_size"], int8["kv_cache_tokens"]) == ("1552", "58976")
    assert (bf16["attention_block_size"], bf16["kv_cache_tokens"]) == ("784", "30576")
    # the flash-attention probe's ERROR lines are expected in the harness and not counted
    text = (REAL / "logs" / "server-fast-int8.log").read_text()
    assert "Cannot use FA version" in text and int8["error_lines"] == []


def test_score_reads_the_real_fault_run_as_failed_tiers():
    from forge.run import score
    c = contest.load_contest()
    run = score.load_run(REAL / "runs" / "fault-upstream", c)
    for name, t in run["tiers"].items():
        assert t["completed"] == 0 and t["failed"] == 1 and t["completion"] == 0.0, name
    killed = json.loads((REAL / "runs" / "fault-upstream" / "4-8K.json").read_text())
    assert "forge_synthesized" not in killed          # written by vLLM's client itself
    assert killed["errors"][0]                          # the client's own error text for the cut request
    base = score.baseline_from_config(c)
    res = score.score(c, run, base)
    assert res["total"] == 0.0 and all("completion" in " ".join(t["zeroed_by"]) for t in res["tiers"].values())


@pytest.mark.parametrize("fixed_kv", [True, False])
def test_servers_start_together_only_with_a_fixed_kv_cache_size(tmp_path, fixed_kv):
    """vLLM sizes its KV cache by profiling the card's memory, which counts another process's
    allocations as its own: without a fixed size the second server may start only once the first
    is up. Each fake server takes 2 s to become healthy."""
    h = tmp_path / "harness.yaml"
    text = (gpu_bundle.HARNESS / "harness.yaml").read_text()
    if not fixed_kv:
        text = text.replace("kv_cache_memory_bytes: 5368709120", "kv_cache_memory_bytes: null")
    h.write_text(text)
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K", "--harness", str(h),
                        env_extra={"FAKE_STARTUP_S": "2"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    ready = {x["step"].split()[1]: x["at_s"] for x in s["steps"] if x["step"].endswith(" ready")}
    gap = ready["upstream"] - ready["fast-int8"]
    assert (gap < 1.0) if fixed_kv else (gap >= 1.8), ready
    assert ("--kv-cache-memory-bytes" in s["harness"]["server_args"]) == fixed_kv


def test_e2e_reruns_a_tier_that_was_recorded_as_failed_for_a_missing_server(tmp_path):
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # as if upstream's server had been gone in that round: the loop records such a tier as failed
    from forge.run import bench
    res = out / "runs" / "upstream" / "4-8K.json"
    res.write_text(json.dumps(bench.failed_result(contest.load_contest(), "4-8K", 1, "server not reachable")))
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    calls = [json.loads(x) for x in (tmp_path / "replay.log").read_text().splitlines()]
    assert len(calls) == 3                      # the failed tier ran again; fast-int8's was kept
    again = json.loads(res.read_text())
    assert "forge_synthesized" not in again
    assert again["completed"] == json.loads((FIXTURE_RUNS / "base" / "4-8K.json").read_text())["completed"]


def test_a_reference_that_served_nothing_gives_no_score_but_a_reason(tmp_path):
    import shutil
    import types

    from forge.run import bench
    c = contest.load_contest()
    dirs = {}
    for name, src in (("fast-int8", "fast"), ("upstream", "died")):
        dirs[name] = tmp_path / name
        shutil.copytree(FIXTURE_RUNS / src, dirs[name])
    assert json.loads((dirs["upstream"] / "16-32K.json").read_text())["completed"] == 0
    run = types.SimpleNamespace(contest=c, summary={}, out=tmp_path)
    assert tiers.scores(run, dirs, "upstream") == {}
    assert "served nothing in tier(s) 16-32K" in run.summary["score_note"]
    assert bench.result_path(dirs["fast-int8"], "4-8K").is_file()


# --- Triton cache carried between machines ----------------------------------------------------------

def _random_cache(root: Path, n: int = 6) -> dict:
    import os
    files = {}
    for i in range(n):                                  # incompressible, so the parts really split
        d = root / os.urandom(4).hex()
        d.mkdir(parents=True)
        files[f"{d.name}/k.cubin"] = os.urandom(7000 + 997 * i)
        (d / "k.cubin").write_bytes(files[f"{d.name}/k.cubin"])
    return files


def test_triton_cache_packs_into_parts_and_seeds_a_fresh_cache(tmp_path):
    files = _random_cache(tmp_path / "cache")
    out = tmp_path / "out"
    out.mkdir()
    (out / f"{packing.TRITON_PARTS}.117").write_bytes(b"stale part of an earlier, larger pack")
    info = packing.pack_triton_cache(tmp_path / "cache", out, part_mib=16 / 1024)   # 16 KiB parts
    man = json.loads((out / packing.TRITON_MANIFEST).read_text())
    parts = sorted(out.glob(f"{packing.TRITON_PARTS}.*"))
    assert info["parts"] == len(parts) == len(man["parts"]) >= 3
    assert [p.name for p in parts] == [x["name"] for x in man["parts"]]       # the stale part is gone
    assert all(p.stat().st_size <= 16 * 1024 for p in parts) and not list(out.glob(".*"))
    fresh = tmp_path / "fresh"
    (fresh / "kept").mkdir(parents=True)
    got = packing.seed_triton_cache(out, fresh)
    assert got["files"] == len(files)
    for rel, body in files.items():
        assert (fresh / rel).read_bytes() == body
    assert (fresh / "kept").is_dir() and not list(fresh.glob(".seed-*"))
    with pytest.raises(ForgeError) as ei:                # a folder without a pack: a wrong path
        packing.seed_triton_cache(tmp_path / "cache", tmp_path / "x")
    assert packing.TRITON_MANIFEST in ei.value.message


@pytest.mark.parametrize("damage", ["missing", "changed"])
def test_a_damaged_pack_is_skipped_and_leaves_the_cache_as_it_was(tmp_path, damage):
    _random_cache(tmp_path / "cache")
    out = tmp_path / "out"
    packing.pack_triton_cache(tmp_path / "cache", out, part_mib=16 / 1024)
    victim = sorted(out.glob(f"{packing.TRITON_PARTS}.*"))[1]
    if damage == "missing":
        victim.unlink()
    else:
        b = bytearray(victim.read_bytes())
        b[100] ^= 0xFF
        victim.write_bytes(bytes(b))
    fresh = tmp_path / "fresh"
    got = packing.seed_triton_cache(out, fresh)
    assert victim.name in got["skipped"]
    assert not fresh.exists() or not any(fresh.iterdir())


def test_seeding_skips_members_outside_the_cache(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "evil.txt").write_text("x")
    (tmp_path / "ok.txt").write_text("y")
    part = src / f"{packing.TRITON_PARTS}.000"
    with tarfile.open(part, "w:gz") as tf:
        tf.add(tmp_path / "evil.txt", arcname="../evil-out.txt")
        tf.add(tmp_path / "ok.txt", arcname="k/ok.txt")
    from forge.hashing import sha256_file
    (src / packing.TRITON_MANIFEST).write_text(json.dumps(
        {"parts": [{"name": part.name, "bytes": part.stat().st_size, "sha256": sha256_file(part)}]}))
    packing.seed_triton_cache(src, tmp_path / "cache")
    assert (tmp_path / "cache" / "k" / "ok.txt").read_text() == "y"
    assert not (tmp_path / "evil-out.txt").exists()


def test_a_resumed_run_estimates_a_tier_from_its_kept_profile(tmp_path):
    """fast-int8's 4-8K kept from an earlier invocation: its measured duration (4.1 s for two
    requests, plus the client's two warm-ups), not the first-measurement guess (~115 s for two
    1024-token requests and their warm-ups), decides whether upstream's 4-8K fits a short deadline."""
    args = ("--no-fault", "--no-plumbing", "--tier-order", "4-8K", "--num-prompts", "2", "--reserve-s", "0",
            "--fixed-output", "1024")
    r, port, out = _e2e(tmp_path, *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for f in (out / "runs" / "upstream").glob("4-8K*"):     # as if the machine's limit had cut it
        f.unlink()
    r, port, out = _e2e(tmp_path, *args, "--deadline-s", "75")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert not s["skipped"], s["skipped"]
    steps = [x["step"] for x in s["steps"]]
    assert "tier 4-8K fast-int8: kept from an earlier invocation" in steps
    assert any(x.startswith("tier 4-8K upstream:") and "kept" not in x for x in steps)
    assert tierguess.guess_s([[8192, 1024]] * 2, 2) > 75            # what it would have refused without the kept one


# --- the tier runs on the H200 (reports/e2e/2026-11-30-h200-*: see reports/e2e/README.md) -----------
# (their files: tests/data/h200-e2e.tgz)

E2E = H200
TIER_RUNS = [E2E / "2026-11-30-h200-contest"]


@pytest.mark.parametrize("ref,basis", [
    ("upstream", "assumes the ratios carry over to the DCU"),
    ("contest", "the ratios are to contest, not upstream: each figure prices only the difference from contest"),
])
def test_dcu_prediction_says_what_its_ratios_are_to(ref, basis):
    """The summary's DCU figures apply ratios to the reference; with a reference other than upstream
    (an A/B of two product profiles) they price only the difference, and the text says so."""
    from types import SimpleNamespace

    from forge.lab import summary
    folder = E2E / "2026-11-30-h200-contest" / "runs"
    run = SimpleNamespace(contest=contest.load_contest(), run_dir=lambda n, create=False: folder / n)
    md = "\n".join(summary.tier_ratio_lines(run, ["contest", "upstream"], ref))
    assert f"ratios to {ref}" in md and basis in md
    other = "upstream" if ref == "contest" else "contest"
    assert f"- {other}: **" in md and f"- {ref}: **" not in md      # the reference is not predicted


def test_the_summary_shows_each_profiles_latency_against_the_slas_limits(tmp_path):
    """A faster configuration can fail the contest's latency gate (reports/e2e/2026-12-06-h100-final-16-32k-int8-8seqs:
    +50 % tok/s, TPOT P99 1.67x upstream's): the summary puts each profile's P99s over the reference's beside the
    limits of configs/contest.yaml, per tier, and names the limit a profile is outside of."""
    from types import SimpleNamespace

    from forge.lab import summary
    c = contest.load_contest()
    p99 = {"upstream": {"8-16K": (40000.0, 30.0), "16-32K": (80000.0, 33.0)},
           "fast-int8": {"8-16K": (30000.0, 31.0), "16-32K": (59000.0, 55.0)},
           "contest": {"16-32K": (130000.0, 30.0)}}
    for prof, tiers_ in p99.items():
        for t, (ttft, tpot) in tiers_.items():
            (tmp_path / prof).mkdir(exist_ok=True)
            (tmp_path / prof / f"{t}.json").write_text(json.dumps({"p99_ttft_ms": ttft, "p99_tpot_ms": tpot}))
    run = SimpleNamespace(contest=c, run_dir=lambda n, create=False: tmp_path / n)
    lines = summary.sla_lines(run, ["fast-int8", "contest", "upstream"], "upstream")
    rows = {tuple(x.strip() for x in ln.strip("|").split("|")[:2]): ln for ln in lines if ln.startswith("| ")}
    assert rows[("8-16K", "fast-int8")].endswith("| 0.75 | 1.03 | within |")
    assert rows[("16-32K", "fast-int8")].endswith("| 0.74 | 1.67 | outside: TPOT |")
    assert rows[("16-32K", "contest")].endswith("| 1.62 | 0.91 | outside: TTFT |")
    assert ("8-16K", "contest") not in rows and not any(k[1] == "upstream" for k in rows if k[0] != "tier")
    limits = c["scoring"]["ttft_p99_max_ratio"], c["scoring"]["tpot_p99_max_ratio"]
    assert f"TTFT P99 at most {limits[0]:g}x" in "\n".join(lines) and f"at most {limits[1]:g}x pooled" in "\n".join(lines)
    # no reference result: nothing to compare, no section
    assert summary.sla_lines(run, ["fast-int8"], "nobody") == []


@pytest.mark.parametrize("folder,expect", [
    ("2026-11-30-h200-fast-int8", {"fast-int8": ("1552", "63632", "6.64"), "upstream": ("784", "32144", "3.71")}),
    ("2026-11-30-h200x2-tp2", {"fast-int8": ("1552", "128816", "13.28"), "upstream": ("784", "65072", "7.42")}),
])
def test_log_facts_of_the_tier_runs(folder, expect):
    """An 8 GiB KV cache per GPU: int8 pages hold 1552-token blocks and ~1.98x the tokens; with
    --tensor-parallel-size 2 each rank holds 2 of the 4 KV heads, so the same 8 GiB holds twice the tokens."""
    for name, (block, tokens, conc) in expect.items():
        f = serverlog.log_facts(E2E / folder / "logs" / f"server-{name}.log")
        assert (f["attention_block_size"], f["kv_cache_tokens"], f["max_concurrency"]) == (block, tokens, conc)
        assert f["error_lines"] == []


@pytest.mark.parametrize("folder", TIER_RUNS, ids=lambda p: p.name)
def test_merged_tier_results_follow_vllms_arithmetic_on_the_real_rounds(folder):
    """Each profile's <tier>.json merges its rounds (real `vllm bench serve` files): output tok/s is
    the rounds' output tokens over their summed durations, requests add up, nothing failed."""
    c = contest.load_contest()
    profs = sorted((folder / "runs").iterdir())
    for t in contest.tier_names(c):
        # the rounds every profile measured for this tier are the ones merged
        have = [{p.parent.name for p in (prof / "rounds").glob(f"r*/{t}.json")} for prof in profs]
        common = sorted(set.intersection(*have))
        assert common, t
        for prof in profs:
            used = [json.loads((prof / "rounds" / r / f"{t}.json").read_text()) for r in common]
            merged = json.loads((prof / f"{t}.json").read_text())
            assert merged["completed"] == sum(r["completed"] for r in used) == len(common)
            assert merged["failed"] == 0
            assert merged["total_output_tokens"] == sum(r["total_output_tokens"] for r in used)
            assert merged["output_throughput"] == pytest.approx(
                sum(r["total_output_tokens"] for r in used) / sum(r["duration"] for r in used), rel=1e-6)


@pytest.mark.parametrize("folder", TIER_RUNS, ids=lambda p: p.name)
def test_the_recorded_proxy_scores_are_reproduced_here(folder):
    """score.json was written on the GPU machine (Python 3.12); scoring the same files here gives it again."""
    from forge.run import score
    c = contest.load_contest()
    base = score.baseline_from_run(folder / "runs" / "upstream", c)
    for prof in (folder / "runs").iterdir():
        rec = json.loads((prof / "score.json").read_text())
        again = score.score(c, score.load_run(prof, c), base)
        assert again["total"] == pytest.approx(rec["total"], rel=1e-12)
        assert {t: v["tok_s"] for t, v in again["tiers"].items()} == {t: v["tok_s"] for t, v in rec["tiers"].items()}


def test_compare_on_the_real_repeats():
    """Round 1 at 16-32K was measured by four upstream servers (two runs, two repeats): one half of
    them against the other is within noise; the submitted profile against them is not."""
    from forge.run import compare, score
    c = contest.load_contest()
    r1 = lambda folder, prof: score.load_run(E2E / folder / "runs" / prof / "rounds" / "r1", c, partial=True)  # noqa: E731
    ups = [r1(f, "upstream") for f in ("2026-11-30-h200-fast-int8", "2026-11-30-h200-repeat-fast-int8",
                                       "2026-11-30-h200-contest", "2026-11-30-h200-repeat-contest")]
    assert ups[1]["missing"] == ["4-8K", "8-16K"] and ups[1]["tpot_p99_pooled_ms"] is None
    same = compare.compare(c, ups[::2], ups[1::2], noise_pct=3)
    assert same["16-32K tok/s"]["within_noise"] and same["16-32K tok/s"]["n_a"] == 2
    assert "4-8K tok/s" not in same                    # the repeats did not run that tier: no row, no guess
    skipped = []
    compare.compare(c, ups[::2], ups[1::2], noise_pct=3, uncompared=skipped)
    assert "4-8K tok/s (no run on side B)" in skipped
    best = [r1(f, "contest") for f in ("2026-11-30-h200-contest", "2026-11-30-h200-repeat-contest")]
    d = compare.compare(c, ups, best, noise_pct=3)["16-32K tok/s"]
    assert not d["within_noise"] and d["delta"] > 0 and (d["n_a"], d["n_b"]) == (4, 2)
    assert "pooled TPOT P99 ms" not in compare.compare(c, ups[1::2], best[1:], noise_pct=3)


def test_make_score_on_a_real_run_folder(tmp_path):
    """`forge score --run … --baseline …` (make score RUN=… BASELINE=…) on the H200 files: the proxy
    total recorded there, and no output-length drift (1024 tokens every request, as the client asks)."""
    import shutil

    from helpers import forge
    src = E2E / "2026-11-30-h200-contest" / "runs"
    for name in ("contest", "upstream"):
        shutil.copytree(src / name, tmp_path / name)
    r = forge(tmp_path, "score", "--run", str(tmp_path / "contest"), "--baseline", str(tmp_path / "upstream"),
              "--force")          # the copied folder holds its recorded score
    assert r.returncode == 0, r.stderr
    rec = json.loads((src / "contest" / "score.json").read_text())
    res = json.loads((tmp_path / "contest" / "score.json").read_text())
    assert res["display"] == rec["display"] and res["total"] == pytest.approx(rec["total"], rel=1e-12)
    assert all(d["differ"] == 0 and d["total_run"] == 1024 * d["compared"] for d in res["output_drift"].values())
    assert f"total {rec['display']}" in r.stdout


@pytest.mark.parametrize("no_fault,summary,live,extra", [
    (False, {"reference": "upstream"}, ["fast-int8", "upstream"], tiers.FAULT_NEED_S),
    (True, {"reference": "upstream"}, ["fast-int8", "upstream"], 0.0),
    (False, {"reference": "upstream", "fault": {"ok": True}}, ["fast-int8", "upstream"], 0.0),
    (False, {"reference": "upstream"}, ["fast-int8"], 0.0),
])
def test_the_tiers_leave_time_for_a_fault_check_still_to_come(no_fault, summary, live, extra):
    import types
    args = types.SimpleNamespace(reserve_s=15.0, no_fault=no_fault)
    assert tiers.tiers_reserve(args, summary, live) == 15.0 + extra


def test_a_profile_added_later_is_measured_beside_the_kept_reference_without_restarting_it(tmp_path):
    """Two servers fit one GPU: a third profile extends the folder while the reference's tiers are
    kept, and no server is started for a profile whose tiers are all kept."""
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K",
                        "--profiles", "fast-int8,upstream")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K",
                        "--profiles", "contest,upstream")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    started = [x["step"] for x in s["steps"] if x["step"].startswith("server ") and x["step"].endswith(" ready")]
    assert started == ["server contest ready"]
    assert any(x.get("profiles") == ["upstream"] for x in s["steps"])
    calls = [json.loads(x)["tier"] for x in (tmp_path / "replay.log").read_text().splitlines()]
    assert calls == ["4-8K"] * 3                      # two in the first invocation, contest's in the second
    # all three merged, no server at all
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K",
                        "--profiles", "fast-int8,contest,upstream")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert not [x for x in s["steps"] if x["step"].endswith(" ready")]
    for name in ("fast-int8", "contest", "upstream"):
        m = json.loads((out / "runs" / name / "manifest.json").read_text())
        assert m["tiers"] == ["4-8K"] and m["model"] and "4-8K" in m["client_commands"]


def test_the_summary_names_the_delivery_stalls_the_client_saw(tmp_path):
    """reports/e2e/2026-12-06-h100-final-16-32k-int8-8seqs: the client got the int8 profile's first wave in
    bursts (70 gaps of a second or more, the longest 11.67 s, 13 to 521 chunks per request of 1024 tokens);
    upstream's tier of the same pair had none, so it gets no row, and a run with none gets no section."""
    from types import SimpleNamespace

    from forge.lab import summary
    with tarfile.open(ROOT / "reports" / "e2e" / "2026-12-06-h100-final-16-32k-int8-8seqs" / "raw.tgz") as tf:
        for prof, folder in (("fast-int8", "h-int8"), ("upstream", "h-up")):
            (tmp_path / prof).mkdir()
            (tmp_path / prof / "16-32K.json").write_bytes(tf.extractfile(f"{folder}/runs/{prof}/16-32K.json").read())
    run = SimpleNamespace(contest=contest.load_contest(), run_dir=lambda n, create=False: tmp_path / n)
    lines = summary.stall_lines(run, ["fast-int8", "upstream"])
    rows = [ln for ln in lines if ln.startswith("| 16-32K")]
    assert rows == ["| 16-32K | fast-int8 | 70 | 11.67 | 13-521 |"], lines
    assert summary.stall_lines(run, ["upstream"]) == []


def test_the_summary_names_requests_that_returned_no_text(tmp_path):
    """reports/e2e/2026-12-07-h100-final-16-32k-int8-same-run: 14 of the 16 requests of each side returned no text
    (a special token repeated and skipped), which held the int8 side's API process; the new client's pair has text
    in every request, so it gets no row, and a failed request is not counted."""
    from types import SimpleNamespace

    from forge.lab import summary
    e2e = ROOT / "reports" / "e2e"
    with tarfile.open(e2e / "2026-12-07-h100-final-16-32k-int8-same-run" / "raw.tgz") as tf:
        (tmp_path / "old").mkdir()
        (tmp_path / "old" / "16-32K.json").write_bytes(tf.extractfile("h-int8s8/runs/fast-int8/16-32K.json").read())
    with tarfile.open(e2e / "2026-12-07-h100-final-16-32k-int8-new-client" / "raw.tgz") as tf:
        (tmp_path / "new").mkdir()
        (tmp_path / "new" / "16-32K.json").write_bytes(tf.extractfile("k-int8/runs/fast-int8/16-32K.json").read())
    run = SimpleNamespace(contest=contest.load_contest(), run_dir=lambda n, create=False: tmp_path / n)
    assert [ln for ln in summary.textless_lines(run, ["old", "new"]) if ln.startswith("| 16-32K")] == \
        ["| 16-32K | old | 14 of 16 |"]
    assert summary.textless_lines(run, ["new"]) == []
    r = json.loads((tmp_path / "old" / "16-32K.json").read_text())
    r["errors"] = ["boom" if not x else "" for x in r["generated_texts"]]
    (tmp_path / "old" / "16-32K.json").write_text(json.dumps(r))
    assert summary.textless_lines(run, ["old"]) == []


def test_the_summary_says_how_many_requests_were_decoding_at_once(tmp_path):
    """reports/e2e/2026-12-07-h100-final-16-32k-int8-new-client: int8 at 8 seqs against upstream at 4, 12 requests.
    From every request's timeline, 5.42 of the int8 side's 8 were decoding at once on average and 3.36 of
    upstream's 4; the mean over the mean TPOT gives each side's output tok/s as the client measured it (the lift
    is the product of the two). A tier run one request at a time gets no row, a run of them no section."""
    from types import SimpleNamespace

    from forge.lab import summary
    with tarfile.open(ROOT / "reports" / "e2e" / "2026-12-07-h100-final-16-32k-int8-new-client" / "raw.tgz") as tf:
        for prof, folder in (("fast-int8", "k-int8"), ("upstream", "k-up")):
            (tmp_path / prof).mkdir()
            for f in ("16-32K.json", "serve.json"):
                (tmp_path / prof / f).write_bytes(tf.extractfile(f"{folder}/runs/{prof}/{f}").read())
    run = SimpleNamespace(contest=contest.load_contest(), run_dir=lambda n, create=False: tmp_path / n)
    rows = {ln.split(" | ")[1]: ln.strip("| ").split(" | ") for ln in summary.residency_lines(run, ["fast-int8", "upstream"])
            if ln.startswith("| 16-32K")}
    assert rows["fast-int8"][2:6] == ["5.42", "8", "8", "68 %"] and rows["upstream"][2:6] == ["3.36", "4", "4", "84 %"]
    for prof in rows:
        r = json.loads((tmp_path / prof / "16-32K.json").read_text())
        assert abs(float(rows[prof][2]) / r["mean_tpot_ms"] * 1000 / r["output_throughput"] - 1) < 0.02
    # one at a time: the same requests laid end to end
    r = json.loads((tmp_path / "upstream" / "16-32K.json").read_text())
    t = 0.0
    for i in range(len(r["start_times"])):
        r["start_times"][i] = t
        t += r["ttfts"][i] + sum(r["itls"][i]) + 0.01
    (tmp_path / "upstream" / "16-32K.json").write_text(json.dumps(r))
    assert summary.residency_lines(run, ["upstream"]) == []
    (tmp_path / "fast-int8" / "serve.json").unlink()                  # no record of the server: no share
    assert "| 16-32K | fast-int8 | 5.42 | 8 | — | — |" in "\n".join(summary.residency_lines(run, ["fast-int8"]))


def test_more_requests_keep_more_of_the_int8_side_decoding(tmp_path):
    """reports/e2e/2026-12-07-h100-final-16-32k-16-requests: the same pair with 16 requests, and the bf16 contest
    profile at upstream's 4 seqs beside it. Two full waves of 8 keep 6.60 of the int8 side's 8 decoding on average
    (5.42 at 12 requests, above); bf16 at 4 seqs holds as many as upstream (3.54 against 3.42), so its lift is its
    step's. Each side's mean over its mean TPOT gives its output tok/s within 2 %, and the lift over upstream is
    the residency ratio over the TPOT ratio."""
    from types import SimpleNamespace

    from forge.lab import summary
    sides = (("upstream", "k-up"), ("fast-int8", "k-int8"), ("contest", "k-bf16"))
    with tarfile.open(ROOT / "reports" / "e2e" / "2026-12-07-h100-final-16-32k-16-requests" / "raw.tgz") as tf:
        for prof, folder in sides:
            (tmp_path / prof).mkdir()
            for f in ("16-32K.json", "serve.json"):
                (tmp_path / prof / f).write_bytes(tf.extractfile(f"{folder}/runs/{prof}/{f}").read())
    run = SimpleNamespace(contest=contest.load_contest(), run_dir=lambda n, create=False: tmp_path / n)
    names = [p for p, _ in sides]
    rows = {ln.split(" | ")[1]: ln.strip("| ").split(" | ") for ln in summary.residency_lines(run, names)
            if ln.startswith("| 16-32K")}
    assert rows["fast-int8"][2:6] == ["6.60", "8", "8", "82 %"]
    assert rows["upstream"][2:6] == ["3.42", "4", "4", "85 %"] and rows["contest"][2:6] == ["3.54", "4", "4", "89 %"]
    res = {p: json.loads((tmp_path / p / "16-32K.json").read_text()) for p in names}
    for p in names:
        assert abs(float(rows[p][2]) / res[p]["mean_tpot_ms"] * 1000 / res[p]["output_throughput"] - 1) < 0.02
        assert res[p]["completed"] == 16 and set(res[p]["output_lens"]) == {1024}
    up = res["upstream"]
    for p in ("fast-int8", "contest"):
        lift = res[p]["output_throughput"] / up["output_throughput"]
        decomposed = (float(rows[p][2]) / float(rows["upstream"][2])) / (res[p]["mean_tpot_ms"] / up["mean_tpot_ms"])
        assert abs(decomposed / lift - 1) < 0.03, (p, lift, decomposed)
    assert summary.textless_lines(run, names) == []


def test_a_profile_measured_alone_is_kept_when_the_reference_joins_with_its_own_capacity(tmp_path):
    """On a card that holds one server at a time: the product's profile alone first, then the same folder with
    the reference added, each at its own --capacity. The second invocation keeps the first's tier (no server
    for it: another profile's capacity measured nothing there) and measures the reference beside it in one
    folder; a changed capacity of the kept profile is still refused (it measured something else)."""
    common = ("--no-fault", "--no-plumbing", "--round", "final", "--tier-order", "8-16K")
    ours = ("--capacity", "fast-int8:max-num-seqs=5")
    r, _, out = _e2e(tmp_path, *common, *ours, "--profiles", "fast-int8")
    assert r.returncode == 0, r.stderr[-3000:]
    first = (out / "runs" / "fast-int8" / "8-16K.json").read_bytes()
    r, _, out = _e2e(tmp_path, *common, *ours, "--capacity", "upstream:max-num-seqs=4",
                     "--profiles", "fast-int8,upstream")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tier 8-16K fast-int8: kept from an earlier invocation" in r.stderr
    assert "starting profile fast-int8" not in r.stderr and "starting profile upstream" in r.stderr
    assert (out / "runs" / "fast-int8" / "8-16K.json").read_bytes() == first
    md = (out / "summary.md").read_text()
    assert "| 8-16K | fast-int8 |" in md and "Latency against upstream per tier" in md
    r, _, _ = _e2e(tmp_path, *common, "--capacity", "fast-int8:max-num-seqs=6", "--capacity", "upstream:max-num-seqs=4",
                   "--profiles", "fast-int8,upstream")
    assert r.returncode == 2 and "ran tier 8-16K on other capacity" in r.stderr, r.stderr[-2000:]


def test_a_final_round_run_gives_one_profile_its_capacity(tmp_path):
    """--round final --capacity: only fast-int8's server gets --max-num-seqs 4 (after the organizers' 128),
    the run records it as a difference and in its identity, and the 16-32K tier is measured (its time is
    guessed with the requests in flight, not one at a time)."""
    r, port, out = _e2e(tmp_path, "--no-fault", "--no-plumbing", "--round", "final", "--tier-order", "16-32K",
                        "--capacity", "fast-int8:max-num-seqs=4")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert not s["skipped"], s["skipped"]
    ours = json.loads((out / "runs" / "fast-int8" / "serve.json").read_text())
    up = json.loads((out / "runs" / "upstream" / "serve.json").read_text())
    assert ours["harness_args"][-2:] == ["--max-num-seqs", "4"]
    assert "--max-num-seqs" not in up["harness_args"]
    caps = [d for d in s["differences"] if d["args"] == ["--max-num-seqs", "4"]]
    assert len(caps) == 1 and "fast-int8's server alone" in caps[0]["why"]
    ident = json.loads((out / "runs" / "fast-int8" / "16-32K.identity.json").read_text())
    assert ident["capacity"] == {"fast-int8": ["--max-num-seqs", "4"]}
    calls = [json.loads(x) for x in (tmp_path / "replay.log").read_text().splitlines()]
    assert len(calls) == 2 and all(c["argv"][c["argv"].index("--max-concurrency") + 1] == "10" for c in calls)
    # each profile's run folder says which round's client measured it, so `forge score --round final` takes it
    for name in ("fast-int8", "upstream"):
        assert json.loads((out / "runs" / name / "manifest.json").read_text())["round"] == "final"
