"""configs/contest.yaml and configs/serve/*.yaml: every forbidden option is refused with its rule's
text, whatever its spelling; typos name the file and key; profiles render the locked command."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import ROOT  # noqa: E402

from forge.errors import ForgeError  # noqa: E402
from forge.run import contest, profiles  # noqa: E402

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


def test_brief_forbidden_options_are_in_the_config(c):
    listed = {n for o in c["forbidden_options"] for n in [o["option"], *o["aliases"]]}
    listed |= {o["option"] for o in c["server"]["locked"]}
    assert set(MUST_REFUSE) <= listed


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
            with pytest.raises(ForgeError, match="forbidden by the contest rules") as e:
                profiles.load_profile(path, c)
            assert c["rules"][o["rule"]]["text"] in str(e.value)


@pytest.mark.parametrize("spelling", ["--max_num_seqs", "--max-num-seqs=8", "--no-enable-chunked-prefill",
                                      "--speculative-config.method", "-q"])
def test_other_spellings_are_caught(c, spelling):
    kind, _ = contest.lookup_option(c, spelling)
    assert kind == "forbidden"


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
    with pytest.raises(ForgeError, match=r"forbidden_options\[0\]\.rule.*schedular"):
        contest.load_contest(str(bad))
    bad.write_text(text.replace("  default: team", "  default: nobody"))
    with pytest.raises(ForgeError, match="baselines.default"):
        contest.load_contest(str(bad))


def test_shipped_profiles_render_the_locked_command(c):
    names = profiles.profile_names()
    assert {"upstream", "int8kv", "fast-decode", "contest"} <= set(names)
    for n in names:
        r = profiles.render(profiles.load_profile(n, c), "/models/q", c)
        assert r["argv"][:7] == ["vllm", "serve", "/models/q", "--port", "8001", "--max-model-len", "32768"]
        assert "127.0.0.1" in r["env"]["NO_PROXY"] and "127.0.0.1" in r["env"]["no_proxy"]
    up = profiles.render(profiles.load_profile("upstream", c), "/m", c)
    fd = profiles.render(profiles.load_profile("fast-decode", c), "/m", c)
    kv = profiles.render(profiles.load_profile("int8kv", c), "/m", c)
    assert up["env"]["VLLM_FORGE_DECODE"] == "0" and fd["env"]["VLLM_FORGE_DECODE"] == "1"
    assert kv["argv"][-2:] == ["--kv-cache-dtype", "int8"] and kv["env"]["VLLM_FORGE_DECODE"] == "0"


def test_check_command_refuses_changed_or_missing_locked_values(c):
    ok = ["--port", "8001", "--max-model-len", "32768", "--served-model-name", "Qwen3.5-27B"]
    contest.check_command(c, ok)
    with pytest.raises(ForgeError, match="locked_command|locked"):
        contest.check_command(c, ["--port", "8001", "--max-model-len", "16384", "--served-model-name", "Qwen3.5-27B"])
    with pytest.raises(ForgeError, match="missing"):
        contest.check_command(c, ["--port", "8001", "--served-model-name", "Qwen3.5-27B"])
    with pytest.raises(ForgeError, match=c["rules"]["scheduler"]["text"].split(" ")[0]):
        contest.check_command(c, ok + ["--max-num-seqs=2"])


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
    path = write_profile(tmp_path, "description: x\noptions:\n  --dtype:\n    value: true\n    effect: e\n")
    with pytest.raises(ForgeError) as e:
        profiles.load_profile(path, c)
    assert "options.--dtype" in str(e.value) and "auto, bfloat16" in str(e.value)
    ok = ["--port", "8001", "--max-model-len", "32768", "--served-model-name", "Qwen3.5-27B"]
    with pytest.raises(ForgeError, match="--dtype"):
        contest.check_command(c, ok + ["--dtype", "--enforce-eager"])
    # a flag the rules take without a value stays a flag; a listed value stays allowed
    path = write_profile(tmp_path, "description: x\noptions:\n  --enforce-eager:\n    value: true\n    effect: e\n"
                                   "  --dtype:\n    value: bfloat16\n    effect: e\n", name="q")
    r = profiles.render(profiles.load_profile(path, c), "/m", c)
    assert r["argv"][-3:] == ["--enforce-eager", "--dtype", "bfloat16"]


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
    ok = ["--port", "8001", "--max-model-len", "32768", "--served-model-name", "Qwen3.5-27B"]
    if value == "true":
        with pytest.raises(ForgeError, match=option):
            contest.check_command(c, ok + [option, "--enforce-eager"])
    else:
        contest.check_command(c, ok + [option, "--block-size", "784"])


def test_a_value_written_into_a_short_option_counts_as_its_value(tmp_path, c):
    """-O3 is --compilation-config with the value 3 (vLLM's spelling), not a bare flag."""
    assert contest.attached_value("-O3") == "3" and contest.attached_value("-O") is None
    assert contest.attached_value("-O.mode") is None and contest.attached_value("--block-size") is None
    ok = ["--port", "8001", "--max-model-len", "32768", "--served-model-name", "Qwen3.5-27B"]
    contest.check_command(c, ok + ["-O3"])
    contest.check_command(c, ok + ["-O", "3", "--enforce-eager"])
    with pytest.raises(ForgeError, match="needs a value"):
        contest.check_command(c, ok + ["-O", "--enforce-eager"])
    path = write_profile(tmp_path, "description: x\noptions:\n  -O3:\n    value: true\n    effect: e\n")
    assert profiles.load_profile(path, c)

