"""What the GPU harness runs, held against the organizers' commands (configs/contest.yaml, their start
script and their `vllm bench serve` line, read as text here): each profile's server command and each
tier's client command differ from theirs by exactly the changes harness/gpu/harness.yaml lists, no
more and no fewer, with vLLM's default compilation config; the list the run records and the harness
README's table are that list; and the fixed KV cache holds a 32K request, by vLLM's own accounting as
the recorded servers printed it."""

import json
import math
import re
import shlex
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import h200_e2e  # noqa: E402

from forge.contest import profiles  # noqa: E402
from forge.contest import rules as contest  # noqa: E402
from forge.errors import ForgeError  # noqa: E402
from forge.lab import gpu_bundle, servers, tiers  # noqa: E402
from forge.run import bench  # noqa: E402

MODEL = Path("/models/Qwen3.5-27B")


def options(argv: list[str]) -> dict[str, str | None]:
    """Options of a command line as argparse reads them: `--opt value` or a bare `--flag`; the last
    of an option given twice wins."""
    out, i = {}, 0
    while i < len(argv):
        a = argv[i]
        assert a.startswith("--"), (a, argv)
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[a] = argv[i + 1]
            i += 2
        else:
            out[a] = None
            i += 1
    return out


def organizers_server(c: dict) -> dict:
    """The organizers' start script's options, from its text."""
    s = c["server"]["start_script"]
    argv = shlex.split(s["command"].replace(s["model_placeholder"], str(MODEL)))
    assert argv[:3] == ["vllm", "serve", str(MODEL)]
    return options(argv[3:])


def organizers_client(c: dict) -> dict:
    argv = shlex.split(c["client"]["command"])
    assert argv[:3] == ["vllm", "bench", "serve"]
    return options(argv[3:])


def _run(names: list[str], first_port: int = 8001, extra: list[str] | None = None):
    c = contest.load_contest()
    h = gpu_bundle.harness_config()
    args = types.SimpleNamespace(first_port=first_port, profile_prefill=None, stack_every=None)
    return types.SimpleNamespace(
        args=args, names=names, contest=c, h=h, hargs=tiers.harness_args(h, extra or []), triton_cache=None,
        profiles={n: profiles.load_profile(n, c) for n in names}, vllm_cmd="python3 -m vllm.entrypoints.cli.main",
        child_env={}, identity={}, out=Path("/nonexistent"), rnd=None, serve_tier=None, capacity={})


def _changes(diffs: list[dict], side: str) -> dict:
    out = {}
    for d in diffs:
        if d["side"] == side:
            out.update(options(d["args"]))
    return out


@pytest.mark.parametrize("names", [gpu_bundle.harness_config()["profiles"], ["fast-int8", "upstream"]])
def test_each_server_command_is_the_organizers_with_exactly_the_listed_changes(names):
    run = _run(names)
    c = run.contest
    diffs = tiers.differences(run.h, [], ports={n: servers.port_of(run, n) for n in names})
    theirs = organizers_server(c)
    assert "--compilation-config" not in theirs and "-O" not in c["server"]["start_script"]["command"].split()
    listed = _changes([d for d in diffs if d["args"][0] != "--port"], "server")
    for name in names:
        launch = servers.plan(run, MODEL, name)["launch"]
        assert launch[:5] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve", str(MODEL)]
        got = options(launch[5:])
        # vLLM's default compilation config: the harness sets none (nor the -O shorthand)
        assert "--compilation-config" not in got and not any(a.startswith("-O") for a in launch)
        # the profile's own reviewed options, as in a contest run
        own = {o: (v.get("value") if not v.get("flag") else None) for o, v in run.profiles[name]["options"].items()}
        port = [d for d in diffs if d["args"][0] == "--port" and d["why"].startswith(f"{name}'s server")]
        want = {**theirs, **own, **listed, **_changes(port, "server")}
        assert got == want, name
        # and nothing listed that is not applied: every listed option differs from the organizers'
        assert all(theirs.get(k, "<unset>") != v for k, v in {**listed, **_changes(port, "server")}.items())
    # the second server's port is a listed difference, the first's (8001) is theirs
    assert [d["args"] for d in diffs if d["args"][0] == "--port"] == [["--port", "8002"]]


def test_the_client_is_the_organizers_with_exactly_the_listed_changes():
    c = contest.load_contest()
    h = gpu_bundle.harness_config()
    diffs = tiers.differences(h, [])
    ch = tiers.harness_contest(c, h)
    argv = bench.client_args(ch, dataset=Path("/d/16-32K.jsonl"), num_prompts=6, model=str(MODEL),
                             host="127.0.0.1", port=8002, result_dir=Path("/r"), result_name="16-32K.client.json")
    assert argv[:2] == ["bench", "serve"]
    got, theirs = options(argv[2:]), organizers_client(c)
    listed = _changes(diffs, "client")
    body = listed.pop("--extra-body")
    assert listed == {"--custom-output-len": "-1", "--ignore-eos": None}
    # their request body, with the special tokens decoded (random weights repeat one; skipped, the API process
    # decodes the whole prompt again at each step of that request), nothing else
    assert json.loads(body) == {**json.loads(theirs["--extra-body"]), "skip_special_tokens": False}
    listed["--extra-body"] = body
    filled = set(tiers.FILLED_IN)
    assert set(c["client"]["per_tier"]) <= filled
    assert {k: v for k, v in got.items() if k not in filled} == \
        {**{k: v for k, v in theirs.items() if k not in filled}, **listed}
    # their warm-ups, their ready check (vLLM's default: none), their sampling
    assert got["--num-warmups"] == "2" and "--ready-check-timeout-sec" not in got
    assert (got["--backend"], got["--endpoint"], got["--temperature"]) == ("openai-chat", "/v1/chat/completions", "0")
    # the per-tier values are the tier's
    assert (got["--dataset-path"], got["--num-prompts"], got["--port"]) == ("/d/16-32K.jsonl", "6", "8002")
    # --fixed-output N replaces the per-request lengths and is recorded as such
    fixed = tiers.differences(h, [], fixed_output=1024)
    assert _changes(fixed, "client") == {"--custom-output-len": "1024", "--ignore-eos": None, "--extra-body": body}
    assert options(bench.client_args(tiers.harness_contest(c, h, 1024), dataset=Path("/d"), num_prompts=1,
                                     model="m", host="h", port=1, result_dir=Path("/r"),
                                     result_name="x")[2:])["--custom-output-len"] == "1024"


def test_the_client_line_names_the_per_tier_values():
    c = contest.load_contest()
    ch = tiers.harness_contest(c, gpu_bundle.harness_config())
    argv = bench.client_args(ch, dataset=Path("/d/4-8K.jsonl"), num_prompts=6, model="/m", host="127.0.0.1",
                             port=8002, result_dir=Path("/r"), result_name="4-8K.client.json")
    line = tiers.client_line(argv)
    assert line.startswith("vllm bench serve --backend openai-chat --endpoint /v1/chat/completions")
    assert "--dataset-path <dataset-path>" in line and "--port <port>" in line
    assert "/d/4-8K.jsonl" not in line and "8002" not in line
    named = [f"<{argv[i - 1][2:]}>" if i and argv[i - 1] in tiers.FILLED_IN else x for i, x in enumerate(argv)]
    assert shlex.split(line) == ["vllm", *named]


def test_the_recorded_list_and_the_readme_table_are_harness_yaml():
    h = gpu_bundle.harness_config()
    diffs = tiers.differences(h, ["--seed", "7"], ports={"contest": 8001, "upstream": 8002})
    for a in h["server_args"]:
        assert {"side": "server", "args": a["args"], "why": a["why"]} in diffs
    for a in h["client_args"]:
        assert {"side": "client", "args": a["args"], "why": a["why"]} in diffs
    assert {"side": "server", "args": ["--seed", "7"], "why": "given to this run (--server-arg, --server-args)"} in diffs
    assert all(d["why"].strip() for d in diffs)
    readme = (gpu_bundle.HARNESS / "README.md").read_text()
    table = readme[readme.index("| harness option | why it differs |"):]
    table = table[:table.index("\n\n")]
    rows = [r.split("|")[1].strip() for r in table.splitlines()[2:]]
    listed = [" ".join(a["args"]) for a in h["server_args"]] + \
        [f"--gpu-memory-utilization {h['side_by_side']['gpu_memory_utilization']}",
         f"--kv-cache-memory-bytes {h['side_by_side']['kv_cache_memory_bytes']}"] + \
        ["client " + " ".join(a["args"]) for a in h["client_args"]]
    assert [re.sub(r"`|\s*\(.*\)$", "", r) for r in rows] == listed


@pytest.mark.parametrize("key,entry,needle", [
    ("server_args", {"args": ["--load-format", "dummy"]}, "server_args[0]"),
    ("server_args", {"args": ["--load-format", "dummy"], "why": " "}, "reason"),
    ("client_args", {"args": ["ignore-eos"], "why": "x"}, "expected a list of strings starting with an option"),
])
def test_a_change_without_its_reason_is_refused(tmp_path, key, entry, needle):
    import yaml
    data = yaml.safe_load((gpu_bundle.HARNESS / "harness.yaml").read_text())
    data[key] = [entry] + data[key][1:]
    bad = tmp_path / "harness.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ForgeError) as e:
        gpu_bundle.harness_config(bad)
    assert needle in e.value.message + (e.value.hint or ""), e.value.message


@pytest.mark.parametrize("log", ["server-fast-int8.log", "server-upstream.log"])
def test_the_fixed_kv_cache_holds_a_32k_request(log):
    """The recorded servers (2026-11-30, 8 GiB each) printed vLLM's own accounting: the KV cache in
    tokens (its blocks over the model's layer groups, times the block size) and the concurrency of
    32,768-token requests (its blocks over what one request takes: the full-attention layers' blocks for
    32,768 tokens and one block per linear-attention group). The harness's 5 GiB, at the same bytes per
    block, still holds one such request, in bf16 and with the int8 KV cache."""
    text = (h200_e2e() / "2026-11-30-h200-fast-int8" / "logs" / log).read_text()
    recorded_bytes = int(re.search(r"'kv_cache_memory_bytes': (\d+)", text).group(1))
    block = int(re.search(r"attention block size to (\d+) tokens", text).group(1)) if "block size to" in text \
        else int(re.search(r"block_size=(\d+)", text).group(1))
    tokens = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))
    max_len, conc = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text).groups()
    max_len = int(max_len.replace(",", ""))
    cfg = json.loads(Path("configs/models/qwen3.5-27b/config.json").read_text())["text_config"]
    kinds = cfg["layer_types"]
    groups = len(kinds) // kinds.count("full_attention")           # 4 groups of 16 layers
    per_request = math.ceil(max_len / block) + (groups - 1)
    per_group = tokens // block                                      # num_blocks // groups
    lo, hi = groups * per_group, groups * per_group + groups - 1   # the blocks vLLM had
    assert lo - 0.01 * per_request <= float(conc) * per_request <= hi + 0.01 * per_request, (conc, lo, hi)
    kv = gpu_bundle.harness_config()["side_by_side"]["kv_cache_memory_bytes"]
    blocks_now = math.floor(kv / (recorded_bytes / lo))            # at the largest bytes per block possible
    assert max_len == 32768 and blocks_now >= per_request, (blocks_now, per_request)
