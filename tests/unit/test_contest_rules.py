"""configs/contest.yaml and configs/serve/*.yaml: every forbidden option is refused with its rule's
text, whatever its spelling; an option the organizers' start script sets is refused citing it;
typos name the file and key; profiles render exactly the organizers' start script."""

import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import ROOT  # noqa: E402

from forge.contest import profiles  # noqa: E402
from forge.contest import rules as contest  # noqa: E402
from forge.errors import ForgeError  # noqa: E402

# The options the contest's rules forbid a team to set (from the design documents), independent of
# configs/contest.yaml: removing one of them from the config must fail this test.
MUST_REFUSE = {
    "--max-num-seqs": "scheduler", "--max-num-batched-tokens": "scheduler", "--scheduling-policy": "scheduler",
    "--enable-chunked-prefill": "scheduler", "--async-scheduling": "scheduler",
    "--speculative-config": "spec_decode", "--quantization": "weight_quant", "-q": "weight_quant",
    "--host": "interface", "--port": "interface", "--served-model-name": "interface",
    "--max-model-len": "locked_command", "--generation-config": "sampling", "--hf-overrides": "model_integrity",
}


@pytest.fixture(scope="module")
def c():
    return contest.load_contest()


def write_profile(tmp_path: Path, body: str, name: str = "p") -> str:
    p = tmp_path / f"{name}.yaml"
    p.write_text(body)
    return str(p)


# The organizers' start script as published (issue 24), independent of configs/contest.yaml.
START_SCRIPT = ("vllm serve $MODEL_DIR --served-model-name Qwen3.5-27B --port 8001 --trust-remote-code "
                "--dtype bfloat16 --tensor-parallel-size 1 --max-num-seqs 128 --max-num-batched-tokens 4096 "
                "--gpu-memory-utilization 0.95 --default-chat-template-kwargs '{\"enable_thinking\": false}' "
                "--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser qwen3_coder")
CLIENT = ("vllm bench serve --backend openai-chat --host 127.0.0.1 --port 8001 --endpoint /v1/chat/completions "
          "--model Qwen3.5-27B --tokenizer $MODEL_DIR --dataset-name custom --dataset-path <tier>.jsonl "
          "--num-prompts <all> --no-oversample --max-concurrency 1 --request-rate 1 --temperature 0 "
          "--disable-shuffle --custom-output-len 1024 --num-warmups 2 --save-detailed "
          "--extra-body '{\"temperature\":0.0}' --percentile-metrics ttft,tpot,itl,e2el "
          "--metric-percentiles 50,95,99 --save-result")


def script_argv(model: str) -> list[str]:
    return [model if a == "$MODEL_DIR" else a for a in shlex.split(START_SCRIPT)]


def script_args() -> list[str]:
    return script_argv("/m")[3:]


def test_brief_forbidden_options_are_in_the_config(c):
    listed = {n for o in c["forbidden_options"] for n in [o["option"], *o["aliases"]]}
    assert set(MUST_REFUSE) <= listed


def test_the_start_script_and_client_are_recorded_verbatim(c):
    assert " ".join(c["server"]["start_script"]["command"].split()) == START_SCRIPT
    assert " ".join(c["client"]["command"].split()) == CLIENT
    assert c["server"]["start_script"]["source"] and c["client"]["source"]
    # every option of the organizers' client is run by bench-all-tiers: as is, or set per tier by the tool
    ours = {o[0]: (o[1] if len(o) > 1 else True) for o in c["client"]["options"]}
    theirs = shlex.split(CLIENT)[3:]
    i = 0
    while i < len(theirs):
        opt = theirs[i]
        val = theirs[i + 1] if i + 1 < len(theirs) and not theirs[i + 1].startswith("--") else True
        i += 1 if val is True else 2
        if opt in c["client"]["per_tier"]:
            assert opt not in ours
        else:
            assert ours.get(opt) == val, f"{opt} {val}"
    assert set(ours) <= set(theirs)


@pytest.mark.parametrize("name", sorted(profiles.profile_names()))
def test_every_profile_renders_the_start_script_then_only_its_reviewed_options(c, name):
    prof = profiles.load_profile(name, c)
    r = profiles.render(prof, "/models/Qwen3.5-27B", c)
    n = len(script_argv("/models/Qwen3.5-27B"))
    assert r["argv"][:n] == script_argv("/models/Qwen3.5-27B")
    assert r["argv"][n:] == profiles.option_args(prof["options"])
    assert set(r["env"]) == set(prof["env"]) | {"NO_PROXY", "no_proxy"}


def test_the_contest_profile_renders_exactly_the_start_script(c):
    r = profiles.render(profiles.load_profile("contest", c), "/root/Qwen3.5-27B", c)
    assert r["argv"] == script_argv("/root/Qwen3.5-27B")


@pytest.mark.parametrize("option,value,also", [("--max-num-seqs", "4", "scheduler"),
                                               ("--max-num-batched-tokens", "8192", "scheduler"),
                                               ("--gpu-memory-utilization", "0.9", None),
                                               ("--reasoning-parser", "deepseek_r1", None),
                                               ("--port", "8002", "interface")])
def test_an_option_the_organizers_set_is_refused_citing_the_start_script(tmp_path, c, option, value, also):
    path = write_profile(tmp_path, f"description: x\noptions:\n  '{option}':\n    value: '{value}'\n    effect: e\n")
    with pytest.raises(ForgeError) as e:
        profiles.load_profile(path, c)
    msg = str(e.value)
    assert "set by the organizers' start script" in msg and c["rules"]["organizers"]["text"] in msg
    if also:
        assert "also forbidden to change" in msg and c["rules"][also]["text"] in msg
    else:
        assert "also forbidden" not in msg


@pytest.mark.parametrize("option,rule", sorted(MUST_REFUSE.items()))
def test_forbidden_option_refused_with_rule_text(tmp_path, c, option, rule):
    path = write_profile(tmp_path, f"description: x\noptions:\n  '{option}':\n    value: '4'\n    effect: e\n")
    with pytest.raises(ForgeError) as e:
        profiles.load_profile(path, c)
    msg = str(e.value)
    assert c["rules"][rule]["text"] in msg
    assert "p.yaml" in msg and f"options.{option}" in msg


def test_every_configured_forbidden_option_is_refused(tmp_path, c):
    for o in c["forbidden_options"]:
        for name in [o["option"], *o["aliases"]]:
            path = write_profile(tmp_path, f"description: x\noptions:\n  '{name}':\n    value: '1'\n    effect: e\n")
            with pytest.raises(ForgeError, match="forbidden") as e:
                profiles.load_profile(path, c)
            assert c["rules"][o["rule"]]["text"] in str(e.value)


@pytest.mark.parametrize("spelling", ["--max_num_seqs", "--max-num-seqs=8", "--no-enable-chunked-prefill",
                                      "--speculative-config.method", "-q"])
def test_other_spellings_are_caught(c, spelling):
    kind, entry = contest.lookup_option(c, spelling)
    assert kind == "forbidden" or kind == "organizers" and entry["also"]


def test_allowed_value_restriction(tmp_path, c):
    path = write_profile(tmp_path, "description: x\noptions:\n  --load-format:\n    value: dummy\n    effect: e\n")
    with pytest.raises(ForgeError) as e:
        profiles.load_profile(path, c)
    assert c["rules"]["weight_quant"]["text"] in str(e.value) and "safetensors" in str(e.value)


def test_unreviewed_option_refused(tmp_path, c):
    path = write_profile(tmp_path, "description: x\noptions:\n  --enable-prefix-caching:\n    value: true\n    effect: e\n")
    with pytest.raises(ForgeError, match="not been reviewed"):
        profiles.load_profile(path, c)


def test_unknown_key_and_wrong_type_name_file_and_key(tmp_path, c):
    path = write_profile(tmp_path, "description: x\nenvv: {}\n")
    with pytest.raises(ForgeError, match=r"p\.yaml: unknown key 'envv'"):
        profiles.load_profile(path, c)
    path = write_profile(tmp_path, "description: x\nenv:\n  VLLM_FORGE_DECODE:\n    value: 1\n    effect: e\n")
    with pytest.raises(ForgeError, match=r"env\.VLLM_FORGE_DECODE\.value.*expected a string"):
        profiles.load_profile(path, c)
    path = write_profile(tmp_path, "description: x\nenv:\n  VLLM_FORGE_DECODE:\n    value: '1'\n")
    with pytest.raises(ForgeError, match=r"missing key 'env\.VLLM_FORGE_DECODE\.effect'"):
        profiles.load_profile(path, c)


def test_contest_config_cross_checks(tmp_path):
    text = (ROOT / "configs" / "contest.yaml").read_text()
    bad = tmp_path / "contest.yaml"
    bad.write_text(text.replace("- {option: --max-num-seqs, rule: scheduler}", "- {option: --max-num-seqs, rule: schedular}"))
    with pytest.raises(ForgeError, match=r"forbidden_options\[\d+\]\.rule.*schedular"):
        contest.load_contest(str(bad))
    bad.write_text(text.replace("  default: team", "  default: nobody"))
    with pytest.raises(ForgeError, match="baselines.default"):
        contest.load_contest(str(bad))


def test_shipped_profiles_render_the_start_script(c):
    names = profiles.profile_names()
    assert {"upstream", "int8kv", "fast-decode", "contest"} <= set(names)
    for n in names:
        r = profiles.render(profiles.load_profile(n, c), "/models/q", c)
        assert r["argv"][:len(script_argv("/models/q"))] == script_argv("/models/q")
        assert "127.0.0.1" in r["env"]["NO_PROXY"] and "127.0.0.1" in r["env"]["no_proxy"]
    up = profiles.render(profiles.load_profile("upstream", c), "/m", c)
    fd = profiles.render(profiles.load_profile("fast-decode", c), "/m", c)
    kv = profiles.render(profiles.load_profile("int8kv", c), "/m", c)
    assert up["env"]["VLLM_FORGE_DECODE"] == "0" and fd["env"]["VLLM_FORGE_DECODE"] == "1"
    assert kv["argv"][-2:] == ["--kv-cache-dtype", "int8"] and kv["env"]["VLLM_FORGE_DECODE"] == "0"


def test_check_command_refuses_changed_or_missing_start_script_values(c):
    ok = script_args()
    contest.check_command(c, ok)
    changed = [("8192" if a == "4096" else a) for a in ok]
    with pytest.raises(ForgeError, match="differs from the start script's 4096") as e:
        contest.check_command(c, changed)
    assert c["rules"]["scheduler"]["text"] in str(e.value)
    i = ok.index("--reasoning-parser")
    with pytest.raises(ForgeError, match="--reasoning-parser qwen3 is missing"):
        contest.check_command(c, ok[:i] + ok[i + 2:])
    with pytest.raises(ForgeError, match="--max-num-seqs given twice"):
        contest.check_command(c, ok + ["--max-num-seqs=2"])
    with pytest.raises(ForgeError, match=c["rules"]["locked_command"]["text"][:40]):
        contest.check_command(c, ok + ["--max-model-len", "16384"])


def test_extends_cycle_is_an_error(tmp_path, c, monkeypatch):
    monkeypatch.setattr(profiles, "PROFILES", tmp_path)
    (tmp_path / "a.yaml").write_text("description: a\nextends: b\n")
    (tmp_path / "b.yaml").write_text("description: b\nextends: a\n")
    with pytest.raises(ForgeError, match="cycle"):
        profiles.load_profile("a", c)


@pytest.mark.parametrize("old,new,key", [
    ("    weight: 20\n", "    weight: -20\n", "tiers[0].weight"),
    ("    weight: 50\n", "    weight: .inf\n", "tiers[1].weight"),
    ("  rate: 1.3", "  rate: 0", "scoring.rate"),
    ("  floor: 0.6", "  floor: .nan", "scoring.floor"),
    ("  ttft_p99_max_ratio: 1.5", "  ttft_p99_max_ratio: -1", "scoring.ttft_p99_max_ratio"),
    ("  tpot_p99_max_ratio: 1.5", "  tpot_p99_max_ratio: 0", "scoring.tpot_p99_max_ratio"),
    ("  min_completion: 0.99", "  min_completion: 7", "scoring.min_completion"),
    ("  min_completion: 0.99", "  min_completion: 0", "scoring.min_completion"),
    ("  display_decimals: 1", "  display_decimals: -3", "scoring.display_decimals"),
    ("{max_loss: 0.02, factor: 0.97}", "{max_loss: 0.02, factor: 1.5}", "scoring.accuracy_factor[1].factor"),
])
def test_contest_config_values_are_range_checked(tmp_path, old, new, key):
    text = (ROOT / "configs" / "contest.yaml").read_text()
    assert old in text
    bad = tmp_path / "contest.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(ForgeError) as e:
        contest.load_contest(str(bad))
    msg = str(e.value)
    assert "contest.yaml" in msg and f"'{key}'" in msg and "allowed:" in msg and "fix:" in msg


def test_contest_config_range_edges_are_accepted(tmp_path):
    text = (ROOT / "configs" / "contest.yaml").read_text()
    ok = tmp_path / "contest.yaml"
    ok.write_text(text.replace("  min_completion: 0.99", "  min_completion: 1").replace(
        "  display_decimals: 1", "  display_decimals: 0"))
    c = contest.load_contest(str(ok))
    assert c["scoring"]["min_completion"] == 1.0 and c["scoring"]["display_decimals"] == 0


def test_a_bare_flag_is_refused_for_an_option_that_takes_values(tmp_path, c):
    path = write_profile(tmp_path, "description: x\noptions:\n  --mamba-ssm-cache-dtype:\n    value: true\n"
                                   "    effect: e\n")
    with pytest.raises(ForgeError) as e:
        profiles.load_profile(path, c)
    assert "options.--mamba-ssm-cache-dtype" in str(e.value) and "auto, float32" in str(e.value)
    with pytest.raises(ForgeError, match="--mamba-ssm-cache-dtype"):
        contest.check_command(c, script_args() + ["--mamba-ssm-cache-dtype", "--enforce-eager"])
    # a flag the rules take without a value stays a flag; a listed value stays allowed
    path = write_profile(tmp_path, "description: x\noptions:\n  --enforce-eager:\n    value: true\n    effect: e\n"
                                   "  --mamba-ssm-cache-dtype:\n    value: float32\n    effect: e\n", name="q")
    r = profiles.render(profiles.load_profile(path, c), "/m", c)
    assert r["argv"][-3:] == ["--enforce-eager", "--mamba-ssm-cache-dtype", "float32"]


@pytest.mark.parametrize("option, value, words", [
    ("--block-size", "true", "needs a value"),            # takes a value; not marked a flag
    ("--kv-cache-dtype", "true", "needs a value"),
    ("--enforce-eager", "'1'", "is a flag and takes no value"),
])
def test_flags_and_valued_options_are_told_apart(tmp_path, c, option, value, words):
    """configs/contest.yaml marks the options vLLM takes bare (`flag: true`); any other allowed option
    given bare, or a flag given a value, would make a command the server refuses."""
    path = write_profile(tmp_path, f"description: x\noptions:\n  {option}:\n    value: {value}\n    effect: e\n")
    with pytest.raises(ForgeError) as e:
        profiles.load_profile(path, c)
    assert f"options.{option}" in str(e.value) and words in str(e.value)
    ok = script_args()
    if value == "true":
        with pytest.raises(ForgeError, match=option):
            contest.check_command(c, ok + [option, "--enforce-eager"])
    else:
        contest.check_command(c, ok + [option, "--block-size", "784"])


def test_a_value_written_into_a_short_option_counts_as_its_value(tmp_path, c):
    """-O3 is --compilation-config with the value 3 (vLLM's spelling), not a bare flag."""
    assert contest.attached_value("-O3") == "3" and contest.attached_value("-O") is None
    assert contest.attached_value("-O.mode") is None and contest.attached_value("--block-size") is None
    ok = script_args()
    contest.check_command(c, ok + ["-O3"])
    contest.check_command(c, ok + ["-O", "3", "--enforce-eager"])
    with pytest.raises(ForgeError, match="needs a value"):
        contest.check_command(c, ok + ["-O", "--enforce-eager"])
    path = write_profile(tmp_path, "description: x\noptions:\n  -O3:\n    value: true\n    effect: e\n")
    assert profiles.load_profile(path, c)

