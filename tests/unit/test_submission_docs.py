"""The submission's ENVIRONMENT.md and OPTIMIZATION.md, written from a fixture run, read as a judge
reads them: no reference to a file the submission repository does not hold (nor an issue number), no
sentence cut short, no unbalanced bracket, a Chinese summary at the top whose numbers are the English
text's, one profile named alike in both, and a run made with another command than the organizers'
start script never presented as the submission's figures.

The reader below knows nothing of the writer: what the submission holds comes from the vendor scope
of configs/upstream.yaml, the overlay's destinations and the files the patches' diffs name."""

import json
import re
import shlex
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, h200_e2e

from forge.contest import profiles
from forge.contest import rules as contest_mod
from forge.ship import contest_docs
from forge.ship.submission_text import References, sentences

TIERS = ["4-8K", "8-16K", "16-32K"]
CJK = re.compile(r"[\u4e00-\u9fff]")
END = tuple(".!?。！？")
PAIRS = ["()", "[]", "{}", "（）"]


# --- the reader ---------------------------------------------------------------------------------

def submission_holds() -> tuple[set[str], set[str]]:
    """(top-level names of the vLLM tree, files our series and overlay put into it)."""
    scope = yaml.safe_load((ROOT / "configs" / "upstream.yaml").read_text())["vendor"]["scope"]
    files = {e["dst"] for e in yaml.safe_load((ROOT / "kernels" / "overlay.yaml").read_text())["files"]}
    for p in (ROOT / "patches").glob("*.patch"):
        files |= set(re.findall(r"^diff --git a/\S+ b/(\S+)$", p.read_text(errors="replace"), re.M))
    return set(scope["folders"]) | set(scope["files"]), files


def units(md: str):
    """(kind, text) of every prose unit: paragraphs, list items, and the cells of a table's body rows;
    code blocks, headings and comments are not prose."""
    lines, out, fence, para = md.splitlines(), [], False, []

    def flush():
        if para:
            out.append(("para", " ".join(para)))
            para.clear()
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("```"):
            flush()
            fence = not fence
            continue
        if fence or s.startswith(("#", "<!--")) or not s:
            flush()
            continue
        if s.startswith("|"):
            flush()
            header = i + 1 < len(lines) and re.match(r"^\|[-|: ]+\|$", lines[i + 1].strip())
            if not header and not re.match(r"^\|[-|: ]+\|$", s):
                out += [("cell", c.strip()) for c in re.split(r"(?<!\\)\|", s.strip("|"))]
            continue
        if re.match(r"^[-*] ", s):
            flush()
            out.append(("item", s[2:]))
        elif line[:1].isspace() and not para and out and out[-1][0] == "item" and lines[i - 1].strip():
            out[-1] = ("item", f"{out[-1][1]} {s}")       # an item's wrapped line
        else:
            para.append(s)
    flush()
    return out


def truncated(md: str) -> list[str]:
    bad = []
    for kind, text in units(md):
        words = len(text.split())
        prose = CJK.search(text) or (words >= 10 if kind == "cell" else words >= 4)
        bare = re.sub(r"`[^`]*`", "`x`", text)
        for o, c in PAIRS:
            if bare.count(o) != bare.count(c):
                bad.append(f"unbalanced {o}{c}: {text[:120]}")
        if prose and not text.rstrip("*_ ").endswith(END):
            bad.append(f"no final punctuation: ...{text[-80:]}")
    return bad


def dangling(md: str) -> list[str]:
    roots, files = submission_holds()
    own = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} | {"design"}
    bad = re.findall(r"\bissues?\s+#?\d+|(?<![\w&#])#\d+\b", md, re.I)
    for w in re.findall(r"(?<![\w/.*-])([\w.*-]+(?:/[\w.*-]*)+)", md):
        w = w.rstrip(".")
        pathlike = re.search(r"\.[A-Za-z]\w{0,5}$", w) or w.endswith("/") or w.split("/")[0] in own | roots
        held = w.split("/")[0] in roots or any(f.endswith("/" + w.rstrip("/")) for f in files)
        if pathlike and not held:
            bad.append(w)
    return bad


def summary_zh(md: str) -> tuple[str, str]:
    """(the first section after the title, the rest of the document)."""
    parts = re.split(r"^## .*$", md, flags=re.M)
    return parts[1], "".join(parts[2:])


def chinese_summary_problems(md: str) -> list[str]:
    zh, rest = summary_zh(md)
    if len(CJK.findall(zh)) < 30:
        return ["no summary in Chinese at the top"]
    nums = lambda s: set(re.findall(r"\d+(?:\.\d+)?", s))  # noqa: E731
    return [f"the Chinese summary's {n} is not in the English text" for n in sorted(nums(zh) - nums(rest))]


def profiles_named(md: str) -> set[str]:
    names = {p.stem for p in (ROOT / "configs" / "serve").glob("*.yaml")}
    return {n for n in re.findall(r"`([\w.-]+)`", md) + re.findall(r"\bprofile ([\w.-]+)", md) if n in names}


def problems(env_md: str, opt_md: str) -> list[str]:
    out = []
    for name, md in (("ENVIRONMENT.md", env_md), ("OPTIMIZATION.md", opt_md)):
        out += [f"{name}: dangling reference {x}" for x in dangling(md)]
        out += [f"{name}: {x}" for x in truncated(md) + chinese_summary_problems(md)]
    a, b = profiles_named(env_md), profiles_named(opt_md)
    if len(a) != 1 or a != b:
        out.append(f"profiles named: ENVIRONMENT.md {sorted(a)}, OPTIMIZATION.md {sorted(b)}")
    return out


# --- the fixture run ----------------------------------------------------------------------------

def fixture_run(tmp: Path, organizers: bool, packed: bool) -> Path:
    """The recorded contest/upstream run of tests/data as a run folder; with organizers=True both servers'
    commands become the organizers' start script plus what a GPU machine cannot avoid."""
    src = h200_e2e() / "2026-11-30-h200-contest"
    run = tmp / ("run-org" if organizers else "run-other")
    contest = contest_mod.load_contest()
    start = shlex.split(yaml.safe_load((ROOT / "configs" / "contest.yaml").read_text())["server"]["start_script"]["command"])
    for p in ("contest", "upstream"):
        (run / "runs" / p).mkdir(parents=True)
        for t in TIERS:
            shutil.copy(src / "runs" / p / f"{t}.json", run / "runs" / p / f"{t}.json")
        serve = json.loads((src / "runs" / p / "serve.json").read_text())
        if organizers:
            serve["launch"] = ["python3", "-m", "vllm.entrypoints.cli.main", *start[1:], "--max-model-len", "32768",
                               "--load-format", "dummy", "--attention-backend", "TRITON_ATTN"]
            serve["env"] = {k: str(e["value"]) for k, e in profiles.load_profile(p, contest)["env"].items()}
        (run / "runs" / p / "serve.json").write_text(json.dumps(serve))
    (run / "summary.json").write_text(json.dumps({"versions": {"device": "NVIDIA H200", "torch": "2.11.0",
                                                               "vllm": "0.18.1+forge.0123456789.gpuharness.x"}}))
    if packed:
        with tarfile.open(run / "raw.tgz", "w:gz") as tf:
            for f in sorted(run.rglob("*.json")):
                tf.add(f, f.relative_to(run).as_posix())
        for d in ("runs",):
            shutil.rmtree(run / d)
        (run / "summary.json").unlink()
    return run


def write_docs(tmp: Path, run: Path) -> tuple[str, str]:
    cfg = yaml.safe_load((ROOT / "configs" / "optimizations.yaml").read_text())
    cfg["submission"].update(run=str(run), profile="contest", reference="upstream")
    for o in cfg["optimizations"]:
        o["ab_runs"] = [{"run": str(run), "with": "contest", "without": "upstream"}] if o.get("ab_runs") else []
    (tmp / "opt.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    docs = contest_docs.documents(contest_mod.load_contest(), "forge submission", "c0ffee" * 7, tmp / "opt.yaml")
    return docs["ENVIRONMENT.md"], docs["OPTIMIZATION.md"]


@pytest.mark.parametrize("organizers,packed", [(False, True), (True, False)], ids=["another-command", "organizers"])
def test_the_documents_read_whole_and_hold_together(tmp_path, organizers, packed):
    env_md, opt_md = write_docs(tmp_path, fixture_run(tmp_path, organizers, packed))
    assert problems(env_md, opt_md) == []
    # the figures are the run's: each server's output tok/s per tier, as recorded
    src = h200_e2e() / "2026-11-30-h200-contest" / "runs"
    for t in TIERS:
        a, b = (json.loads((src / p / f"{t}.json").read_text())["output_throughput"] for p in ("contest", "upstream"))
        assert f"| {t} | {a:.2f} | {b:.2f} | {(a / b - 1) * 100:+.1f} % |" in opt_md
    # a run under another command is never the submission's figures, in either language; one under the
    # organizers' command is not labelled so
    zh, en = summary_zh(opt_md)[0], opt_md
    assert ("not the submission's figures" in en and "不是本提交" in zh) is (not organizers)
    assert ("--compilation-config" in en) is (not organizers)
    # the fixture's build is the GPU machine's (a .gpuharness. version): the stand-ins for vllm._C are said
    assert "was replaced for both servers by stand-ins" in en


def test_a_run_of_a_real_build_is_not_said_to_run_stand_ins(tmp_path):
    run = fixture_run(tmp_path, True, False)
    (run / "summary.json").write_text(json.dumps({"versions": {"device": "BW", "torch": "2.10.0",
                                                               "vllm": "0.18.1+forge.0123456789"}}))
    env_md, opt_md = write_docs(tmp_path, run)
    assert problems(env_md, opt_md) == []
    assert "stand-ins" not in opt_md


def test_the_route_on_the_card_is_the_series_rocm_table():
    """The three one-token shapes and the fused gate_up of the ROCm table, read from the patch text here."""
    text = (ROOT / "patches" / "gemv_vllm_forge_gemv_routes_1_4_token_bf16_linear_layers_and.patch").read_text()
    table = re.search(r"^\+FORGE_GEMV_ROCM[^{]*\{(.*?)^\+\}", text, re.M | re.S).group(1)
    shapes = [f"{n}x{k}" for n, k in re.findall(r"\((\d+), (\d+)\): frozenset\(\{1\}\)", table)]
    assert len(shapes) == 3
    en, _ = contest_docs.gemv_on_card()
    assert "three one-token shapes" in en and all(s in en for s in shapes)
    assert "gate_up + SiLU-and-mul to our fused kernel, at 1 token (gate_up 34816x5120)" in en


def test_a_table_installed_for_the_card_is_what_the_documents_describe(tmp_path, monkeypatch):
    from forge.ship import card_route
    table = {"schema": "forge-tuned/1", "validators": {"device_name": "BW", "arch": "gfx936", "compute_units": 80},
             "gemv": {"plain": {"5120x17408": {"1": [0, 0], "2": [0, 0]}, "14336x5120": {"1": [0, 0]}},
                      "fused": {}}}
    (tmp_path / "bw-gfx936-80cu.json").write_text(json.dumps(table))
    monkeypatch.setattr(card_route.tree, "overlay_entries", lambda: [
        {"src": str(tmp_path / "bw-gfx936-80cu.json"), "dst": "vllm/forge_tuned/bw-gfx936-80cu.json"}])
    en, zh = card_route.gemv_on_card()
    assert "`bw-gfx936-80cu.json`" in en and "down 5120x17408 at 1 and 2 tokens" in en
    assert "qkv+gate 14336x5120 at 1 token" in en and "three one-token shapes" in en   # the built-in, where it fails
    assert "5120x17408（1、2 个 token）" in zh


def test_a_card_table_with_mma_entries_names_the_skinny_gemm_at_those_token_counts(tmp_path, monkeypatch):
    from forge.ship import card_route
    table = {"schema": "forge-tuned/1", "validators": {"device_name": "BW", "arch": "gfx936", "compute_units": 80},
             "gemv": {"plain": {"5120x17408": {"1": [0, 0], "2": [640, 2], "5": "mma", "16": "mma"},
                                "14336x5120": {"8": "mma"}},
                      "fused": {"34816x5120": {"1": [0, 0], "12": "mma"}}}}
    (tmp_path / "bw-gfx936-80cu.json").write_text(json.dumps(table))
    monkeypatch.setattr(card_route.tree, "overlay_entries", lambda: [
        {"src": str(tmp_path / "bw-gfx936-80cu.json"), "dst": "vllm/forge_tuned/bw-gfx936-80cu.json"}])
    en, zh = card_route.gemv_on_card()
    assert "one shape to our GEMV: down 5120x17408, at 1 and 2 tokens" in en
    assert "to our fused kernel, at 1 token (gate_up 34816x5120)" in en
    assert ("and to our skinny GEMM on the matrix units: down 5120x17408 at 5 and 16 tokens; qkv+gate 14336x5120 "
            "at 8 tokens; gate_up 34816x5120 (fused with SiLU-and-mul) at 12 tokens") in en
    assert "并让 down 5120x17408（5、16 个 token）" in zh and "走我们在矩阵单元上的 skinny GEMM" in zh


# --- the reader can fail: what each check refuses ---------------------------------------------------

ZH = "## 摘要\n\n本提交不需要设置任何环境变量，所有优化在代码中默认开启，共有 7 个变量，所测配置为 `contest`。\n\n"
GOOD = f"# T\n\n{ZH}## Summary\n\nThere are 7 variables; the profile `contest` sets them.\n"


@pytest.mark.parametrize("bad,found", [
    ("At batch 1 the decode step is GEMV-bound (design/contest-facts.md).", "dangling reference design/contest-facts.md"),
    ("Measured in reports/e2e/2026-12-01-h200-gemv-upstream by the harness.", "dangling reference reports/e2e"),
    ("Checked by tests/tree/test_gemv_dispatch.py on every shape.", "dangling reference tests/tree"),
    ("Timed with kernels/bench/bench_gemv.py on an H200 machine.", "dangling reference kernels/bench"),
    ("The harness cannot run it yet, see issue 30 for the plan.", "dangling reference issue 30"),
    ("The int8 patch already moved long int8 queries to 64-row tiles;", "no final punctuation"),
    ("Public runs: strided GEMVs took TPOT 69 -> 45 ms,", "no final punctuation"),
    ("The route takes three shapes (qkv+gate, in_proj_qkvz and gate_up.", "unbalanced ()"),
    ("| `X` | `1` | what it does | the kernel beats rocBLAS at every large shape we measured so far: |",
     "no final punctuation"),
])
def test_the_reader_refuses_each_defect(bad, found):
    assert problems(GOOD, GOOD) == []
    table = "| a | b | c | d |\n|---|---|---|---|\n" if bad.startswith("|") else ""
    md = GOOD + "\n" + table + bad + "\n"
    assert any(found in p for p in problems(md, GOOD)), problems(md, GOOD)


def test_the_reader_refuses_a_missing_summary_drifting_numbers_and_two_profiles():
    no_zh = GOOD.replace(ZH, "## Summary zero\n\nPlain words only here.\n\n")
    assert "ENVIRONMENT.md: no summary in Chinese at the top" in problems(no_zh, GOOD)
    drift = GOOD.replace("共有 7 个变量", "共有 8 个变量")
    assert "ENVIRONMENT.md: the Chinese summary's 8 is not in the English text" in problems(drift, GOOD)
    other = GOOD.replace("the profile `contest`", "the profile `contest-gemv`").replace("为 `contest`", "为 `contest-gemv`")
    assert any(p.startswith("profiles named:") for p in problems(GOOD, other))


# --- the text extraction ----------------------------------------------------------------------------

def test_sentences_split_outside_brackets_and_abbreviations():
    text = ("At 1 row it wins (117 vs. 240 us; see the table. Twice). Public runs took TPOT 69 -> 45 ms; fusing "
            "gave -5.2 %. Values e.g. 2.3x stay whole.")
    assert sentences(text) == ["At 1 row it wins (117 vs. 240 us; see the table. Twice).",
                               "Public runs took TPOT 69 -> 45 ms; fusing gave -5.2 %.", "Values e.g. 2.3x stay whole."]


def test_clean_keeps_whole_sentences_and_renames_overlay_files():
    refs = References([{"src": "kernels/csrc/forge_gemv.cu", "dst": "csrc/forge/forge_gemv.cu"}],
                      ["vllm/model_executor/layers/utils.py"], ["vllm", "csrc"], ["kernels", "tests", "design"])
    text = ("At batch 1 decode is GEMV-bound (63.1 of ~71 ms; design/contest-facts.md). Our GEMV\n"
            "(kernels/csrc/forge_gemv.cu) is built into _C. Checked by tests/tree/test_x.py. The table\n"
            "lives in model_executor/layers/utils.py.\n\n- Timed with kernels/bench/bench_gemv.py.\n"
            "- Two shapes (14336x5120; reports/kernels/gemv/) win.")
    assert refs.clean(text) == [
        ("para", "At batch 1 decode is GEMV-bound (63.1 of ~71 ms). Our GEMV (csrc/forge/forge_gemv.cu) is built "
                 "into _C. The table lives in model_executor/layers/utils.py."),
        ("item", "Two shapes (14336x5120) win.")]


def test_the_tracked_documents_are_current_and_read_whole(tmp_path):
    """reports/submission/ holds what `forge report` writes now, and it passes the reader."""
    docs = contest_docs.documents(contest_mod.load_contest(), "forge report")
    for name, text in docs.items():
        assert (ROOT / "reports" / "submission" / name).read_text() == text, f"rerun `make report`: {name}"
    assert problems(docs["ENVIRONMENT.md"], docs["OPTIMIZATION.md"]) == []


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["submission"].update(run="reports/e2e/no-such-run"),
     "key 'submission.run': reports/e2e/no-such-run holds no recorded run"),
    (lambda c: c["submission"].update(profile="fast-int8"),
     "key 'submission.profile' or 'submission.reference': run run-other served no profile 'fast-int8'"),
    (lambda c: c["submission"].update(profile="nope"), "profile 'nope' not found"),
    (lambda c: c["optimizations"][0].update(patches=["nope.patch"]),
     "key 'optimizations[0].patches': nope.patch is not in patches/series"),
    (lambda c: c["optimizations"][0].update(switch="X"), "unknown key 'optimizations[0].switch'"),
    (lambda c: c["optimizations"][0].pop("name_zh"), "missing key 'optimizations[0].name_zh'"),
])
def test_a_mistake_in_the_configuration_names_its_key(tmp_path, edit, message):
    from forge.errors import ForgeError
    cfg = yaml.safe_load((ROOT / "configs" / "optimizations.yaml").read_text())
    cfg["submission"]["run"] = str(fixture_run(tmp_path, False, True))
    edit(cfg)
    (tmp_path / "opt.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    with pytest.raises(ForgeError, match=re.escape(message)):
        contest_docs.documents(contest_mod.load_contest(), "forge submission", None, tmp_path / "opt.yaml")
