"""Inputs found to be taken wrongly in the twenty-third round of input hardening.

A --gpu-memory-utilization with more than 6 significant digits (`forge sweep --round final
--gpu-memory-utilization 0.95,0.9500000001`, `forge predict --round final` or `forge plan --round final` with
0.9500000001, GPU_MEMORY_UTILIZATION=0.9500000001 for `forge serve --round final`, a tier-environment file's
0.97000001): taken, and named with 6 digits wherever forge writes it (the sweep's run folders and ranking, the
model's labels, the headroom's lines). The sweep kept one of 0.95 and 0.9500000001 under the other's name (one
configuration ranked and served); predict listed two rows "util 0.95"; serve warned that "3.20 GiB outside vLLM's
budget at utilization 0.95" does not hold the pool, "set GPU_MEMORY_UTILIZATION to 0.95 or less". Each is now
refused by the round's reader, naming the option (or the variable, or the file and key), with at most 6
significant digits as the fix; nothing written.

`forge serve --round final` above 0.95 on a DCU machine whose hy-smi answers as it does ("HCU[0] : vram Total
Memory (MiB): 65520"; "DCU[i]" on some drivers): nothing was read (rocm-smi's "VRAM Total Memory (B)" alone was), so
the warning priced a 64 GiB card, whatever the card: two 16 GiB cards at 0.97 were said to hold the pool. hy-smi's
figures are read in their unit now (B, KiB, MiB or GiB), as rocm-smi's are.

A card's figure that is no memory: nvidia-smi's "0" (or rocm-smi's "VRAM Total Memory (B): 0") was taken as a card of
0 bytes (serve warned "0.00 GiB outside vLLM's budget ... no --max-num-seqs fits there"; e2e-gpu's fit check blamed
--kv-cache-memory-bytes for a card of 0 bytes); "[N/A]" for one card was skipped, so the next card's figure went to it
(CUDA_VISIBLE_DEVICES=0,1 priced cards 1 and 2). The tool's answer is not read now, said in a warning naming the tool,
the card and its figure; the next tool is asked, else the card is priced as a DCU card, as where no tool answers.

`forge serve --round final` above 0.95 with a device variable listing more cards than the server's ranks take
(CUDA_VISIBLE_DEVICES=0,1,2 for TP1/DP2): the warning priced the smallest card of all three, one no rank uses. It
prices the cards the ranks take (the first ones listed) now, as e2e-gpu's fit check does; without a device variable
every card still counts (the runtime's order may not be the tool's).

`forge sweep --round final` with a start-script variable mistyped in the environment (GPU_MEMORY_UTILIZATION_4_8k,
MAX_NUM_SEQS_48K, concurrency_4_8k): the sweep wrote its record and the baseline's profile, then the baseline's
server start refused the variable. Refused before anything is written now, with "unset it" as the fix (the sweep
sets each configuration's values; renamed, the variable would override them).

`forge bench-all-tiers --round final` with the client's variable mistyped (CONCURRENCY_4_8k=8, CONCURRENCY_48K=8):
read by nothing, the client ran at the round's concurrency 10 (and the run folder was written), where `forge serve
--round final` refuses it. Refused as serve refuses it now, naming the variable and the name it reads as.

`forge plan --out DIR` (or `plan --against RUN --out DIR`, `predict --round final --out DIR`, with --validate too)
where DIR holds the result's .md (plan.md, plan-check.md, predict-final.md, validation.md) but not its .json: the .md
was replaced without --force, where the .json alone is refused as "recorded there". Either file is the record now:
refused, naming it, with --force or another --out as the fix; nothing written.

`forge report --round final --tier-env FILE` (or `submission --round final`) where a tier's winner has a `sweep` or
`run` that is no name (null, a number, text with a line break): taken, ENVIRONMENT.md said "sweep None", and in the
note of a tier above 0.95 the line break ended the list and "## Injected" became a heading of the submission's
document. Refused now as the file's other keys are, naming the file and key; nothing written.

`make plan ROUND=final UTIL=1.2` (or UTIL=+0.9, KV_DTYPE=fp8): refused naming --gpu-memory-utilization (--kv-dtype)
with "e.g. --gpu-memory-utilization 0.95" as the fix, options the user never typed, where TIER was already named as
TIER. Named as the variable now, the fix written as one (UTIL=0.95); typed as the option, named as the option.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import forge, free_port, tiny_model
from test_bad_inputs import refused, writes_nothing
from test_bad_inputs_round5 import fix_line
from test_bad_inputs_round21 import CARDS, ONE, SWEEP


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("round23-model"))


# --- a utilization with more digits than forge writes ----------------------------------------------------------------

LONG = "more than 6 significant digits: forge's runs, records and lines would name it 0.95, as they name 0.95 itself"


def test_sweep_final_refuses_a_utilization_its_runs_would_name_otherwise(tmp_path, model):
    """Taken before: the two utilizations were one candidate (tp1dp2-bf16-s8-b4096-u0.95-c8), 0.95 dropped."""
    values = {**ONE, "--gpu-memory-utilization": "0.95,0.9500000001"}
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(model), "--tier-env", str(tmp_path / "te.json"),
                  *[x for kv in values.items() for x in kv], **CARDS)
    refused(r, "--gpu-memory-utilization 0.9500000001 has " + LONG)
    assert fix_line(r) == "  fix: write at most 6 significant digits, e.g. 0.95", r.stderr


@pytest.mark.parametrize("args", [
    ["plan", "--round", "final", "--gpu-memory-utilization", "0.9500000001"],
    ["predict", "--round", "final", "--speedup", "gemv=1.1", "--gpu-memory-utilization", "0.95,0.9500000001"],
])
def test_plan_and_predict_refuse_a_utilization_their_rows_would_name_otherwise(tmp_path, args):
    """Taken before: plan's rows and predict's labels said "util 0.95" (predict twice, for two configurations)."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, "--gpu-memory-utilization 0.9500000001 has " + LONG)
    assert "e.g. 0.95" in fix_line(r), r.stderr


def test_serve_final_refuses_a_utilization_variable_its_warning_would_name_otherwise(tmp_path):
    """Taken before, with the warning "at utilization 0.95 does not hold ...: set GPU_MEMORY_UTILIZATION to 0.95
    or less"."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--round", "final", "--tier", "16-32K", "--dry-run", "--profile", "contest",
                  GPU_MEMORY_UTILIZATION="0.9500000001", TENSOR_PARALLEL_SIZE="1", DATA_PARALLEL_SIZE="2")
    refused(r, "GPU_MEMORY_UTILIZATION='0.9500000001' (environment)", "'0.9500000001' has " + LONG)
    assert "set GPU_MEMORY_UTILIZATION to a number of at most 6 significant digits within 0.1..1" in fix_line(r)


def test_a_tier_environment_files_utilization_with_more_digits_is_refused(tmp_path):
    """Taken before: ENVIRONMENT.md shipped GPU_MEMORY_UTILIZATION=0.97000001 with a note "at utilization 0.97"."""
    env = {"TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2", "MAX_NUM_SEQS": "6",
           "MAX_NUM_BATCHED_TOKENS": "4096", "GPU_MEMORY_UTILIZATION": "0.97000001", "CONCURRENCY_8_16K": "10"}
    te = tmp_path / "te.json"
    te.write_text(json.dumps({"round": "final", "tiers": {"8-16K": {
        "environment": env, "engine_options": {}, "kv_dtype": "bf16", "run": "r-8", "sweep": "s1"}}}))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(te), "--out", str(tmp_path / "o"))
    refused(r, "te.json: key 'tiers.8-16K.environment'", "'0.97000001' has more than 6 significant digits")


def test_a_utilization_of_six_digits_is_taken(tmp_path):
    r = forge(tmp_path, "plan", "--round", "final", "--tier", "4-8K", "--gpu-memory-utilization", "0.951234")
    assert r.returncode == 0 and "--gpu-memory-utilization 0.951234," in r.stdout, r.stderr


# --- the cards' memory as their tools report it ----------------------------------------------------------------------

def _tools(tmp_path, **answers: str) -> dict:
    """nvidia-smi, hy-smi and rocm-smi first on PATH: each given one prints its answer, the others fail (as a tool
    with no card does), whatever this machine has."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("nvidia-smi", "hy-smi", "rocm-smi"):
        text = answers.get(tool.replace("-", "_"))
        p = bin_dir / tool
        p.write_text("#!/bin/sh\n" + (f"printf '%s\\n' {' '.join(repr(x) for x in text.splitlines())}\n"
                                       if text is not None else "exit 1\n"))
        p.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _serve_above(tmp_path, model, cards: str = "0,1", **tools: str):
    """`forge serve --round final` of the 16-32K tier at TP1/DP2, 0.97 and --max-num-seqs 16 (a DCU card's outside
    memory holds its pool, an H200's too, a 16 GiB card's not), vLLM `false`: what it says before the start fails."""
    return forge(tmp_path, "serve", "--round", "final", "--tier", "16-32K", "--profile", "contest", "--model", str(model),
                 "--vllm", "false", "--timeout", "5", "--port", str(free_port()), GPU_MEMORY_UTILIZATION="0.97",
                 TENSOR_PARALLEL_SIZE="1", DATA_PARALLEL_SIZE="2", MAX_NUM_SEQS="16", CUDA_VISIBLE_DEVICES=cards,
                 **_tools(tmp_path, **tools))


def _headroom_warning(r) -> str:
    return next((x for x in r.stderr.splitlines() if "may fail to start" in x), "")


@pytest.mark.parametrize("label", ["HCU", "DCU"])
def test_serve_reads_hy_smis_figures_in_mib(tmp_path, model, label):
    """Not read before: priced as a 64 GiB DCU card, which holds 16 sequences' pool at 0.97 (no warning)."""
    r = _serve_above(tmp_path, model, hy_smi=f"{label}[0]          : vram Total Memory (MiB): 16368\n"
                                             f"{label}[0]          : vram Total Used Memory (MiB): 51\n"
                                             f"{label}[1]          : vram Total Memory (MiB): 16368")
    assert "tier 16-32K (hy-smi, CUDA_VISIBLE_DEVICES=0,1: 16.0 GiB): 0.48 GiB outside" in _headroom_warning(r), r.stderr


@pytest.mark.parametrize("answer,card,figure", [
    ("0\n143771", 0, "'0' is not a number of MiB above 0"),            # a card of 0 bytes: "no --max-num-seqs fits"
    ("[N/A]\n16000\n143771", 0, "'[N/A]' is not a number of MiB above 0"),   # cards 1 and 2 priced as 0 and 1
])
def test_serve_does_not_price_a_card_figure_that_is_no_memory(tmp_path, model, answer, card, figure):
    """Before: warned for a card of 0 bytes, or of the 16000 MiB card 1 as if it were card 0."""
    r = _serve_above(tmp_path, model, nvidia_smi=answer)
    assert f"[forge] warning: nvidia-smi: card {card}'s total memory {figure}: no card's memory is read from " \
           "nvidia-smi's answer" in r.stderr, r.stderr
    assert _headroom_warning(r) == "", r.stderr          # priced as a DCU card, which holds the pool


def test_card_memory_reads_no_answer_with_a_figure_that_is_no_memory():
    """The same in the reader e2e-gpu's fit check takes (there a card of 0 bytes blamed --kv-cache-memory-bytes)."""
    from forge.contest import cards
    from forge.errors import ForgeError

    def tool(name, text):
        def run(cmd):
            if cmd[0] != name:
                raise ForgeError(f"{cmd[0]}: not found")
            return text
        return run
    assert cards.card_memory({}, tool("rocm-smi", "GPU[0]\t\t: VRAM Total Memory (B): 0\n")) is None
    assert cards.card_memory({}, tool("nvidia-smi", "81559 MiB\n")) is None
    assert cards.card_memory({}, tool("hy-smi", "HCU[0] : vram Total Memory (MiB): 65520\n")) == \
        ([65520 << 20], "hy-smi")


def test_serve_prices_the_cards_the_ranks_take(tmp_path, model):
    """Before: priced at the third card (16000 MiB), which the two ranks of TP1/DP2 do not take."""
    r = _serve_above(tmp_path, model, cards="0,1,2", nvidia_smi="143771\n143771\n16000")
    assert _headroom_warning(r) == "", r.stderr
    r = _serve_above(tmp_path / "small", model, cards="2,0,1", nvidia_smi="143771\n143771\n16000")
    assert "(nvidia-smi, CUDA_VISIBLE_DEVICES=2,0,1: 15.6 GiB)" in _headroom_warning(r), r.stderr


# --- a start-script variable mistyped: the sweep, the finals' client -------------------------------------------------

@pytest.mark.parametrize("var,reads_as", [("GPU_MEMORY_UTILIZATION_4_8k", "GPU_MEMORY_UTILIZATION_4_8K"),
                                          ("MAX_NUM_SEQS_48K", "MAX_NUM_SEQS_4_8K"),
                                          ("concurrency_4_8k", "CONCURRENCY_4_8K")])
def test_sweep_final_refuses_a_mistyped_variable_before_its_record(tmp_path, model, var, reads_as):
    """Before: sweeps/<id>/sweep.json and the baseline's profile written, then the baseline's start refused."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *SWEEP, "--model", str(model), "--tier-env", str(tmp_path / "te.json"),
                  *[x for kv in ONE.items() for x in kv], **CARDS, **{var: "8"})
    refused(r, f"{var}='8' (environment), the final round's sweep: not a variable of the final round, so nothing "
               f"reads it (it reads as {reads_as})")
    assert fix_line(r) == "  fix: unset it for the sweep (the sweep sets each configuration's values)", r.stderr


@pytest.mark.parametrize("var", ["CONCURRENCY_4_8k", "CONCURRENCY_48K"])
def test_bench_final_refuses_a_mistyped_concurrency_variable(tmp_path, var):
    """Before: read by nothing, the client given --max-concurrency 10 (the round's) with a server up."""
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "bench-all-tiers", "--round", "final", "--tiers", "4-8K", "--port", str(free_port()),
                  "--model", "/m", **{var: "8"})
    refused(r, f"{var}='8' (environment), the final round's client: not a variable of the final round, so nothing "
               "reads it (it reads as CONCURRENCY_4_8K)")
    assert fix_line(r) == "  fix: rename it CONCURRENCY_4_8K, or unset it", r.stderr


# --- --out: the result's .md alone is a record too -------------------------------------------------------------------

@pytest.mark.parametrize("args,md", [
    (["plan", "--round", "final", "--tier", "4-8K"], "plan.md"),
    (["plan", "--against", "some-run"], "plan-check.md"),
    (["predict", "--round", "final", "--speedup", "gemv=1.1", "--concurrency", "10"], "predict-final.md"),
    (["predict", "--round", "final", "--validate"], "validation.md"),
])
def test_an_out_holding_the_results_md_alone_is_not_replaced_without_force(tmp_path, args, md):
    """Before: the .md replaced (the new result written beside it), exit 0."""
    out = tmp_path / "out"
    out.mkdir()
    (out / md).write_text("notes kept here\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, "--out", str(out))
    refused(r, f"out/{md}: a ", "is recorded there")
    assert fix_line(r) == "  fix: --force replaces it (FORCE=1), or give another --out", r.stderr


# --- a tier-environment file: the winner's sweep and run are names ---------------------------------------------------

@pytest.mark.parametrize("key,value,words", [
    ("run", "r-8\n\n## Injected", "not a plain name (it holds a control character, such as a line break)"),
    ("sweep", None, "None is not a name"),
    ("sweep", 5, "5 is not a name"),
])
def test_a_tier_environment_files_winner_names_its_sweep_and_run(tmp_path, key, value, words):
    """Before: ENVIRONMENT.md written with "sweep None", or with a heading the file's run id carried."""
    env = {"TENSOR_PARALLEL_SIZE": "1", "DATA_PARALLEL_SIZE": "2", "MAX_NUM_SEQS": "6",
           "MAX_NUM_BATCHED_TOKENS": "4096", "GPU_MEMORY_UTILIZATION": "0.97", "CONCURRENCY_8_16K": "10"}
    te = tmp_path / "te.json"
    te.write_text(json.dumps({"round": "final", "tiers": {"8-16K": {
        "environment": env, "engine_options": {}, "kv_dtype": "bf16", "run": "r-8", "sweep": "s1", key: value}}}))
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "report", "--round", "final", "--tier-env", str(te), "--out", str(tmp_path / "o"))
    refused(r, f"te.json: key 'tiers.8-16K.{key}': {words}")
    assert "restore the file" in fix_line(r), r.stderr


# --- make plan UTIL=... / KV_DTYPE=...: the refusal names the variable the user wrote ----------------------------------
# `make plan ROUND=final UTIL=1.2` was refused as "--gpu-memory-utilization '1.2'", with "e.g.
# --gpu-memory-utilization 0.95" as the fix: an option the user never typed (TIER was already named as TIER). Named
# now as UTIL (KV_DTYPE for the dtype), the fix written as the variable is: UTIL=0.95.

@pytest.mark.parametrize("var,option,value,said,fix", [
    ("UTIL", "--gpu-memory-utilization", "1.2", "UTIL '1.2': expected a number > 0 and <= 1", "e.g. UTIL=0.95"),
    ("UTIL", "--gpu-memory-utilization", "+0.9", "UTIL '+0.9': a sign before the number", "e.g. UTIL=0.9"),
    ("KV_DTYPE", "--kv-dtype", "fp8", "KV_DTYPE 'fp8': not a KV cache dtype", "bf16, int8"),
])
def test_make_plan_names_its_variable(tmp_path, var, option, value, said, fix):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "plan", "--round", "final", option, value, MAKELEVEL="1", **{var: value})
    refused(r, said)
    assert fix in fix_line(r), r.stderr
    with writes_nothing(tmp_path):             # the same value typed as the option is named as the option
        r = forge(tmp_path, "plan", "--round", "final", option, value)
    refused(r, f"{option} '{value}'")
