"""`forge e2e-gpu`'s extra server arguments (--server-arg, --server-args) against the contest's rules: an
option the rules forbid (speculative decoding, weight quantization, the scheduler's options, in any
spelling: `--opt=v`, `--opt_name`, a short alias), one the organizers' command sets (the last one given wins
in vLLM, so it would change the command under test) and, in the final round, a setting the round opens per
tier (given through --capacity or --finals-servers, where it is checked within the round's bounds) were all
appended to every server's command. Each is refused before anything is written or started: exit code 2, the
argument and the rule named, a `fix:` line, `git status` as it was; an argument the rules leave open still
passes the check. Also `forge bench-all-tiers`' --num-prompts 0 (read as "not given": the whole tier ran) and
--progress-every 0 or below.
"""

from __future__ import annotations

import pytest
from helpers import forge, tiny_model
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round5 import fix_line


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round6-model"))


def e2e(tmp_path, model, round_name, *extra):
    return forge(tmp_path, "e2e-gpu", "--bundle", "", "--model", str(model), "--round", round_name, "--profiles",
                 "contest,upstream", "--out", str(tmp_path / "out"), "--vllm", "false", "--client", "false",
                 "--no-plumbing", "--no-fault", "--start-guess-s", "0", *extra)


@pytest.mark.parametrize("round_name,arg,words,fix", [
    ("final", '--server-arg=--speculative-config={"method":"ngram"}', ["--speculative-config", "rule 'spec_decode'"],
     "leave it out"),
    ("final", "--server-arg=-q", ["-q", "rule 'weight_quant'"], "leave it out"),
    ("preliminary", "--server-args=--quantization fp8", ["--quantization", "rule 'weight_quant'"], "leave it out"),
    # the harness sets 32768 itself; vLLM keeps the last value given
    ("final", "--server-arg=--max_model_len=100", ["--max_model_len=100", "rule 'locked_command'"], "leave it out"),
    # past the round's bound of 1..1024 that --capacity enforces
    ("final", "--server-arg=--max-num-seqs=5000", ["--max-num-seqs=5000", "rule 'final_unlocked'"],
     "--capacity PROFILE:max-num-seqs=N"),
    ("final", "--server-args=--max-num-batched-tokens 8192", ["--max-num-batched-tokens", "rule 'final_unlocked'"],
     "--capacity PROFILE:max-num-batched-tokens=N"),
    ("final", "--server-arg=--tensor-parallel-size=2", ["--tensor-parallel-size=2", "rule 'final_topology'"],
     "--finals-servers"),
    # the preliminary opens none of them: the organizers' start script sets --max-num-seqs
    ("preliminary", "--server-arg=--max-num-seqs=4", ["--max-num-seqs=4", "start script sets --max-num-seqs"],
     "leave it out"),
])
def test_extra_server_arguments_the_rules_close_are_refused(tmp_path, model, round_name, arg, words, fix):
    with writes_nothing(tmp_path):
        r = e2e(tmp_path, model, round_name, arg)
    refused(r, *words)
    assert fix in fix_line(r), r.stderr


def test_an_extra_argument_the_rules_leave_open_passes_the_rules_check(tmp_path, model):
    """--enforce-eager (not among the forbidden or the organizers' options): the run goes past the check and is
    refused later, by the deadline it cannot hold, not by a rule."""
    with writes_nothing(tmp_path):
        r = e2e(tmp_path, model, "final", "--server-arg=--enforce-eager", "--deadline-s", "1")
    err = refused(r, "--deadline-s")
    assert "rule" not in err, err


@pytest.mark.parametrize("args,words", [
    # 0 was read as "not given": the whole tier ran (80 requests in the final round), exit 0
    (["--round", "final", "--num-prompts", "0"], ["--num-prompts", "'0' is not a count"]),
    (["--progress-every", "0"], ["--progress-every", "'0' is not seconds > 0"]),
    (["--progress-every", "-1"], ["--progress-every", "'-1' is not seconds > 0"]),
])
def test_bench_all_tiers_counts_and_seconds(tmp_path, args, words):
    """bench-all-tiers' --num-prompts 0 and --progress-every 0 or below (before any server is looked for)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "bench-all-tiers", *args)
    refused(r, *words)


def test_serve_timeout_of_zero_seconds_is_refused(tmp_path):
    """--timeout 0 (or below) waited no time for /health; with --dry-run it exited 0."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--profile", "contest", "--dry-run", "--model", str(tmp_path), "--timeout", "0")
    refused(r, "--timeout", "'0' is not seconds > 0")


@pytest.mark.parametrize("args,words", [
    # the second --tier was planned, the first dropped without a word
    (["plan", "--round", "final", "--tier", "4-8K", "--tier", "8-16K"], ["--tier", "given twice ('4-8K', then '8-16K')"]),
    (["serve", "--profile", "contest", "--profile", "upstream", "--dry-run", "--model", "m"],
     ["--profile", "given twice ('contest', then 'upstream')"]),
    (["predict", "--round", "final", "--speedup", "gemv=1.1", "--link", "pcie", "--link=oneshot"], ["--link", "given twice"]),
])
def test_a_one_value_option_given_twice_is_refused(tmp_path, args, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, *words)
