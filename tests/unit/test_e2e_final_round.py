"""`forge e2e-gpu --round final` on a CPU box: the finals' client in place of the preliminary's (and
only there), the servers' sizing recorded as the run's differences, the official prompt lengths with
the finals' output length, and the preemption counter read from a server's Prometheus text."""

import http.server
import threading
import types

import pytest

from forge.contest import rules as contest
from forge.errors import ForgeError
from forge.lab import final_round, gpu_bundle, tierguess, tiers


def _args(**kw):
    base = dict(round="preliminary", concurrency=None, fixed_output=None, kv_cache_memory_bytes=None,
                gpu_memory_utilization=None, kv_why=None, finals_servers=False)
    return types.SimpleNamespace(**{**base, **kw})


def _client_options(h):
    c = tiers.harness_contest(contest.load_contest(), h)
    return {o[0]: o[1:] for o in c["client"]["options"]}


def test_the_final_rounds_client_replaces_the_preliminarys():
    h = final_round.apply_to_harness(gpu_bundle.harness_config(), _args(round="final", concurrency=7))
    opts = _client_options(h)
    assert opts["--max-concurrency"] == ["7"] and opts["--request-rate"] == ["inf"]
    assert opts["--custom-output-len"] == ["1024"] and "--ignore-eos" in opts
    # the preliminary keeps its own: one request at a time, each its official output length
    pre = _client_options(final_round.apply_to_harness(gpu_bundle.harness_config(), _args()))
    assert pre["--max-concurrency"] == ["1"] and pre["--request-rate"] == ["1"]
    assert pre["--custom-output-len"] == ["-1"]
    # both rounds' harness clients keep the special tokens in the replies (harness.yaml), each option once
    assert opts["--extra-body"] == pre["--extra-body"] == ['{"temperature":0.0,"skip_special_tokens":false}']
    assert len(tiers.harness_contest(contest.load_contest(), h)["client"]["options"]) == len(opts)


@pytest.mark.parametrize("kw, words", [
    (dict(round="final", concurrency=0), "1 to 256"),
    (dict(round="final", fixed_output=512), "fixes the output length"),
    (dict(concurrency=4), "one request at a time"),
    (dict(kv_cache_memory_bytes=1024), "256 MiB"),
    (dict(gpu_memory_utilization=1.2), "0.05-0.99"),
    (dict(finals_servers=True), "add --round final"),
])
def test_bad_final_round_options_are_refused(kw, words):
    with pytest.raises(ForgeError, match=words):
        final_round.apply_to_harness(gpu_bundle.harness_config(), _args(**kw))


def test_the_sizing_replaces_the_side_by_side_values_and_says_why():
    h = final_round.apply_to_harness(gpu_bundle.harness_config(), _args(
        round="final", kv_cache_memory_bytes=7398752256, gpu_memory_utilization=0.47, kv_why="a DCU card's"))
    argv = tiers.harness_args(h, [])
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "7398752256"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.47"
    diffs = {d["args"][0]: d for d in tiers.differences(h, [])}
    assert diffs["--kv-cache-memory-bytes"]["why"] == "a DCU card's"
    assert diffs["--request-rate"]["side"] == "client"
    # the run's own share, not harness.yaml's reason for its 0.44 (a run of one server said "two servers share
    # one GPU, side by side")
    why = diffs["--gpu-memory-utilization"]["why"]
    assert "(--gpu-memory-utilization)" in why and "side by side" not in why, why
    default = {d["args"][0]: d for d in tiers.differences(final_round.apply_to_harness(gpu_bundle.harness_config(),
                                                                                       _args(round="final")), [])}
    assert "side by side" in default["--gpu-memory-utilization"]["why"]


def test_the_final_rounds_requests_are_official_prompt_lengths_with_1024_outputs():
    c = contest.load_contest()
    pairs = final_round.workload_pairs(c, "16-32K", 12)
    assert len(pairs) == 12 and {o for _, o in pairs} == {1024}
    lo, hi = next(t["prompt_tokens"] for t in c["tiers"] if t["name"] == "16-32K")
    assert all(lo <= p <= hi for p, _ in pairs)
    assert len({p for p, _ in pairs}) > 1          # spread over the tier, not one length


def _serve(body: str):
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_preemptions_are_read_from_the_servers_counter():
    text = ("# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n"
            "# TYPE vllm:num_preemptions_total counter\n"
            'vllm:num_preemptions_total{engine="0",model_name="Qwen3.5-27B"} 17.0\n'
            'vllm:num_preemptions_total{engine="1",model_name="Qwen3.5-27B"} 3.0\n'
            'vllm:num_requests_running{engine="0"} 9.0\n')
    srv = _serve(text)
    try:
        assert final_round.preemptions("127.0.0.1", srv.server_address[1]) == 20.0
    finally:
        srv.shutdown()
    srv = _serve("vllm:num_requests_running 1.0\n")
    try:
        assert final_round.preemptions("127.0.0.1", srv.server_address[1]) is None
    finally:
        srv.shutdown()


def test_the_summary_names_the_clients_concurrency():
    from forge.lab.summary import concurrency_words
    assert concurrency_words("vllm bench serve --max-concurrency 10 --request-rate inf") == \
        "concurrency 10, request rate inf"
    assert concurrency_words("vllm bench serve --max-concurrency 1 --request-rate 1") == "concurrency 1"


def _plan_run(names, finals, capacity=None):
    from pathlib import Path

    from forge.contest import profiles, rounds
    c = contest.load_contest()
    rnd = rounds.load_round(c, "final") if finals else None
    return types.SimpleNamespace(
        capacity=final_round.capacity_changes(c, capacity, names, "final" if capacity else "preliminary"),
        args=types.SimpleNamespace(first_port=8001, profile_prefill=None, stack_every=None), names=names, contest=c, rnd=rnd,
        serve_tier="8-16K" if finals else None, hargs=["--load-format", "dummy"], triton_cache=None,
        vllm_cmd="python3 -m vllm.entrypoints.cli.main", child_env={}, identity={},
        profiles={n: profiles.load_profile(n, c, rnd=rnd) for n in names}), Path(__file__).parent


def test_the_finals_servers_render_their_topology_and_upstream_the_finals_baseline(tmp_path):
    from forge.lab import servers
    (tmp_path / "config.json").write_text("{}")
    run, _ = _plan_run(["final-dp2", "upstream"], finals=True)
    dp2 = servers.plan(run, tmp_path, "final-dp2")["launch"]
    assert dp2[dp2.index("--data-parallel-size") + 1] == "2" and dp2[dp2.index("--tensor-parallel-size") + 1] == "1"
    assert "--data-parallel-backend" in dp2 and dp2[-2:] == ["--load-format", "dummy"]
    up = servers.plan(run, tmp_path, "upstream")["launch"]
    assert up[up.index("--tensor-parallel-size") + 1] == "2" and up[up.index("--max-num-seqs") + 1] == "128"
    # without --finals-servers: the preliminary's one-card server, and a final-round profile is refused
    run, _ = _plan_run(["upstream"], finals=False)
    one = servers.plan(run, tmp_path, "upstream")["launch"]
    assert one[one.index("--tensor-parallel-size") + 1] == "1" and "--data-parallel-size" not in one
    with pytest.raises(ForgeError, match="final round"):
        _plan_run(["final-tp2"], finals=False)


NAMES = ["contest", "upstream"]


def test_capacity_gives_one_profile_its_own_value_checked_within_the_rounds_bounds():
    ch = final_round.capacity_changes(contest.load_contest(), ["contest:max-num-seqs=4,max-num-batched-tokens=8192"],
                                      NAMES, "final")
    assert final_round.capacity_args(ch, "contest") == ["--max-num-seqs", "4", "--max-num-batched-tokens", "8192"]
    assert final_round.capacity_args(ch, "upstream") == []
    assert all("contest's server alone" in c["why"] for c in ch["contest"])
    assert final_round.capacity_changes(contest.load_contest(), None, NAMES, "preliminary") == {}


def test_capacity_reaches_only_its_profiles_server_after_the_organizers_value(tmp_path):
    from forge.lab import servers
    (tmp_path / "config.json").write_text("{}")
    run, _ = _plan_run(NAMES, finals=False, capacity=["contest:max-num-seqs=4"])
    ours = servers.plan(run, tmp_path, "contest")["launch"]
    # the one-card command keeps the organizers' 128; the later value is the one vLLM's parser keeps
    assert ours[-2:] == ["--max-num-seqs", "4"] and ours.count("--max-num-seqs") == 2
    up = servers.plan(run, tmp_path, "upstream")["launch"]
    assert up[up.index("--max-num-seqs") + 1] == "128" and up.count("--max-num-seqs") == 1


@pytest.mark.parametrize("specs, rnd, words", [
    (["contest:max-num-seqs=4"], "preliminary", "only in the final round"),
    (["contest"], "final", "PROFILE:OPTION=VALUE"),
    (["contest:"], "final", "PROFILE:OPTION=VALUE"),
    (["fast:max-num-seqs=4"], "final", "not among this run's profiles"),
    (["contest:max-model-len=4096"], "final", "is not one of"),
    (["contest:gpu-memory-utilization=0.5"], "final", "is not one of"),
    (["contest:max-num-seqs"], "final", "is not one of"),
    (["contest:max-num-seqs=0"], "final", "out of bounds"),
    (["contest:max-num-seqs=1_000"], "final", "max-num-seqs"),
    (["contest:max-num-seqs=4.5"], "final", "max-num-seqs"),
    (["contest:max-num-seqs=4", "contest:max-num-seqs=5"], "final", "given twice"),
])
def test_bad_capacity_is_refused(specs, rnd, words):
    with pytest.raises(ForgeError, match=words) as e:
        final_round.capacity_changes(contest.load_contest(), specs, NAMES, rnd)
    # the fix names the option given, not the start script's environment variable
    assert "MAX_NUM_SEQS" not in (e.value.hint or "")


def test_a_tiers_time_guess_counts_the_requests_in_flight():
    # 12 requests of ~22K prompt tokens and 1024 outputs, two warm-ups: at concurrency 10 capped by
    # --max-num-seqs 4 the guess is the serial time over 4 (times the batch slowdown), not the serial time,
    # and the two warm-ups run together (vLLM's client gathers them under its concurrency)
    reqs = [[22000, 1024]] * 12
    serial = tierguess.guess_s(reqs, 2)
    four = tierguess.guess_s(reqs, 2, tierguess.inflight(["--max-concurrency", "10"], ["--max-num-seqs", "128",
                                                                               "--max-num-seqs", "4"]))
    one = reqs[0][0] / tierguess.GUESS_PREFILL_TOKENS_S + 1024 * tierguess.GUESS_TPOT_S
    slow = 1 + 4 * tierguess.GUESS_SLOWDOWN_PER_REQUEST * (22000 / tierguess.GUESS_PROMPT_SCALE) ** tierguess.GUESS_PROMPT_EXPONENT
    assert four == pytest.approx(tierguess.CLIENT_TURN_S + one + 12 * one / 4 * slow)
    # longer prompts in flight slow a step more than shorter ones (more KV per step, longer prefills)
    assert tierguess.batch_slowdown(8, 22000) > tierguess.batch_slowdown(8, 6000) > 1
    # outside the tiers' prompts (where it was fitted) the prompt term is held at their edge
    short = [[1000, 1024]] * 12
    one_short = 1000 / tierguess.GUESS_PREFILL_TOKENS_S + 1024 * tierguess.GUESS_TPOT_S
    assert tierguess.guess_s(short, 2, 4) == pytest.approx(
        tierguess.CLIENT_TURN_S + one_short + 12 * one_short / 4 * tierguess.batch_slowdown(4, 4096))
    assert four < serial / 2
    # the preliminary's client (one at a time) and a missing --max-num-seqs change nothing
    assert tierguess.inflight(["--max-concurrency", "1"], ["--max-num-seqs", "128"]) == 1
    assert tierguess.inflight(["--max-concurrency", "10"], []) == 10
    assert tierguess.guess_s(reqs, 2, 1) == serial
