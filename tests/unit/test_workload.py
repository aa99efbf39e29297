"""configs/workload.yaml, the contest's request shape: the config is consistent with the figures it
quotes, is validated on load, and `forge bench-all-tiers` without official data sends exactly its
(input_len, output_len) pairs: prompt token counts checked with the tokenizer library directly and
the chat template written out by hand (tests/support/tinymodel.py), output lengths per line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import FIXTURE_RUNS, ROOT, SUPPORT, fake_server, forge_env, tiny_model  # noqa: E402

from forge.contest import rules as contest  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.run import synth  # noqa: E402

REPLAY = f"{sys.executable} {SUPPORT / 'replayclient.py'}"
TIERS = ["4-8K", "8-16K", "16-32K"]


@pytest.fixture(scope="module")
def c():
    return contest.load_contest()


@pytest.fixture(scope="module")
def w(c):
    return synth.load_workload(c)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def client_count(model: Path, prompt: str) -> int:
    """What vLLM's client counts for a custom-dataset line with the tiny model: its chat template
    (tinymodel.CHAT_TEMPLATE, for one user message, with the generation prompt) written out here,
    tokenized by the `tokenizers` library."""
    from tokenizers import Tokenizer
    text = f"<|im_start|> user {prompt} <|im_end|> <|im_start|> assistant "
    return len(Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids)


def test_config_agrees_with_the_figures_it_quotes(w):
    # the official run: 50 requests per tier, tok/s = total output tokens / duration, the published
    # mean output lengths 249 / 274 / 235 and prompt ranges (min / max)
    published = {"4-8K": (249.3, 4236, 8034), "8-16K": (273.8, 8307, 16027), "16-32K": (235.2, 20528, 22401)}
    for t in TIERS:
        reqs = w["tiers"][t]["requests"]
        b = w["tiers"][t]["baseline"]
        outs = [o for _, o in reqs]
        assert len(reqs) == 50
        assert sum(outs) / b["duration_s"] == pytest.approx(b["output_tok_s"], rel=2e-3)
        mean, lo, hi = published[t]
        assert sum(outs) / 50 == pytest.approx(mean, abs=0.06)
        assert (min(i for i, _ in reqs), max(i for i, _ in reqs)) == (lo, hi)
    assert "public repository" in w["source"] and w["output_cap"] == 1024


def test_stratified_subset_is_evenly_spaced_by_output_length():
    pairs = [(100 + i, o) for i, o in enumerate([9, 1, 7, 3, 5, 10, 2, 8, 4, 6])]
    # ranked by output 1..10; 5 of 10 take ranks 1, 3, 5, 7, 9 (0-based): outputs 2, 4, 6, 8, 10,
    # returned in the original order
    assert synth.stratified(pairs, 5) == [(105, 10), (106, 2), (107, 8), (108, 4), (109, 6)]
    assert synth.stratified(pairs, 1) == [(109, 6)]          # the median-ranked request
    assert synth.stratified(pairs, 10) == pairs and synth.stratified(pairs, None) == pairs
    with pytest.raises(ForgeError, match="at least 1"):
        synth.stratified(pairs, 0)


@pytest.mark.parametrize("old,new,msg", [
    ("      - [7574, 88]\n", "      - [70, 88]\n", r"tiers\.4-8K\.requests\[0\]': input_len 70 is outside"),
    ("      - [7574, 88]\n", "      - [7574, 2000]\n", r"requests\[0\]': output_len 2000 is outside 1-1024"),
    ("      - [7574, 88]\n", "      - [7574]\n", r"requests\[0\]': expected \[input_len, output_len\]"),
    ("      - [7574, 88]\n", "      - [7574.5, 88]\n", r"requests\[0\]': expected \[input_len, output_len\]"),
    ("      output_tok_s: 12.208\n", "      output_tok_s: .nan\n", r"tiers\.4-8K\.baseline\.output_tok_s"),
    ("  16-32K:\n", "  16-32k:\n", "needs exactly the contest's tiers"),
    ("output_cap: 1024\n", "output_cap: many\n", "output_cap"),
])
def test_bad_workload_config_names_the_key(tmp_path, c, old, new, msg):
    text = (ROOT / "configs" / "workload.yaml").read_text()
    assert old in text
    bad = tmp_path / "workload.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(ForgeError, match=msg):
        synth.load_workload(c, bad)


def test_built_dataset_has_exactly_the_configured_shape(tmp_path, w, model):
    for t in TIERS:
        pairs = synth.stratified(w["tiers"][t]["requests"], 4)
        out = tmp_path / f"{t}.jsonl"
        info = synth.build_workload_tier(model, t, pairs, out)
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert [(client_count(model, x["prompt"]), x["output_tokens"]) for x in lines] == pairs
        assert info["input_lens"] == [i for i, _ in pairs] and info["chat_template"] is True
        again = tmp_path / "again.jsonl"
        synth.build_workload_tier(model, t, pairs, again)
        assert again.read_bytes() == out.read_bytes()          # deterministic


def _bench(tmp_path, port, model, *extra, env):
    cmd = [sys.executable, "-m", "forge", "bench-all-tiers", "--port", str(port), "--model", str(model),
           "--client", REPLAY, "--run-id", "wl", "--profile", "test", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("harness", [False, True])
def test_bench_without_data_sends_the_contest_shape(tmp_path, w, model, harness):
    log = tmp_path / "replay.log"
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(log))
    with fake_server(model) as (port, _):
        r = _bench(tmp_path, port, model, "--num-prompts", "5", *(["--harness"] if harness else []), env=env)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "runs" / "wl"
    man = json.loads((run / "manifest.json").read_text())
    assert man["harness"] is harness
    calls = {json.loads(x)["tier"]: json.loads(x)["argv"] for x in log.read_text().splitlines()}
    for t in TIERS:
        argv = calls[t]
        assert argv[argv.index("--custom-output-len") + 1] == "-1"
        assert ("--ignore-eos" in argv) is harness                # end-of-text ignored for random weights only
        assert argv[argv.index("--num-prompts") + 1] == "5"
        ds = Path(argv[argv.index("--dataset-path") + 1])
        want = synth.stratified(w["tiers"][t]["requests"], 5)
        lines = [json.loads(x) for x in ds.read_text().splitlines()]
        assert [(client_count(model, x["prompt"]), x["output_tokens"]) for x in lines] == want
        assert man["datasets"][t]["requests"] == [list(p) for p in want]


def test_official_data_keeps_the_contest_client_options(tmp_path, model):
    data = tmp_path / "data"
    data.mkdir()
    for f in ("4-8K_throughput.jsonl", "8-16K_throughput.jsonl", "16-32K_throughput.jsonl"):
        (data / f).write_text("".join(json.dumps({"prompt": f"w{i} w2 w3"}) + "\n" for i in range(3)))
    log = tmp_path / "replay.log"
    env = forge_env(tmp_path, REPLAY_FROM=str(FIXTURE_RUNS / "base"), REPLAY_LOG=str(log), DATA_DIR=str(data))
    with fake_server(model) as (port, _):
        r = _bench(tmp_path, port, model, env=env)
    assert r.returncode == 0, r.stderr
    for x in log.read_text().splitlines():
        argv = json.loads(x)["argv"]
        assert argv[argv.index("--custom-output-len") + 1] == "1024" and "--ignore-eos" not in argv
