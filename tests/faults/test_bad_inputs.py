"""Bad inputs a new user gives, each refused before anything is written: exit code 2, one error line
naming the cause (and a `fix:` line), no file written or changed, `git status` as it was. Grouped by
class: names that become paths, archives, result files, option values, server records, patches,
profiles, hints, help and the documented examples."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from helpers import FIXTURE_RUNS, ROOT, forge, forge_env, free_port
from project import make_project
from project import run as run_in

TIERS = ["4-8K", "8-16K", "16-32K"]
HEAD_CHECK = "reports/e2e/2026-12-02-h200-head-check"       # a recorded, packed e2e results folder


# --- what every refusal is checked for ------------------------------------------------------------

def git_status() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True, check=True).stdout


def files_under(*roots: Path) -> dict:
    out = {}
    for root in roots:
        for p in sorted(Path(root).rglob("*")) if Path(root).exists() else []:
            st = p.lstat()
            out[str(p)] = "folder" if p.is_dir() and not p.is_symlink() else (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@contextmanager
def writes_nothing(*roots: Path):
    """No file or folder under `roots` appears, changes or goes, and the checkout's status is as it was."""
    before, status = files_under(*roots), git_status()
    yield
    after = files_under(*roots)
    assert after == before, {"new or changed": sorted(k for k in after if after[k] != before.get(k)),
                             "gone": sorted(k for k in before if k not in after)}
    assert git_status() == status, "the checkout changed"


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, no traceback, one error line holding `words`; every other line is its fix or progress."""
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if re.match(r"^forge( [\w-]+)?: error: ", x)]
    assert len(errors) == 1, r.stderr
    assert all(x in errors or x.startswith(("  fix: ", "[forge] ")) or re.match(r"make(\[\d+\])?: \*\*\* ", x)
               for x in lines), r.stderr
    for w in words:
        assert w in errors[0], (w, r.stderr)
    return errors[0]


def copy_runs(tmp_path: Path) -> tuple[Path, Path]:
    run, base = tmp_path / "run", tmp_path / "base"
    shutil.copytree(FIXTURE_RUNS / "fast", run)
    shutil.copytree(FIXTURE_RUNS / "base", base)
    return run, base


def edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps(fn(data)))


def make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = forge_env(tmp_path, PY=sys.executable)
    return subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def tgz(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    with tarfile.open(path, "w:gz") as tf:
        for info, body in members:
            tf.addfile(info, io.BytesIO(body) if body is not None else None)


def member(name: str, kind: bytes = tarfile.REGTYPE, body: bytes | None = b"x", link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    if kind == tarfile.REGTYPE:
        info.size = len(body or b"")
    return info, body if kind == tarfile.REGTYPE else None


# --- 1, 10, 15: names and folders that become paths --------------------------------------------------

@pytest.mark.parametrize("into", [".", "scripts/forge", str(ROOT)])
def test_export_into_the_checkout_is_refused(tmp_path, into):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "export", "--into", into, "--out", str(tmp_path / "out"), timeout=60)
    refused(r, "--into", "inside this checkout")


@pytest.mark.parametrize("args,words", [
    (["export", "--into", ""], ["--into", "empty value"]),
    (["unpack-run", HEAD_CHECK, "--to", ""], ["--to", "empty value"]),
    (["score", "--tok-s", "13,9,6", "--baseline-name", ""], ["--baseline-name", "empty value"]),
    (["predict", "--speedup", "gemv=2", "--baseline-name", ""], ["--baseline-name", "empty value"]),
])
def test_an_empty_value_is_not_taken_as_omitted(tmp_path, args, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, timeout=60)
    refused(r, *words)


@pytest.mark.parametrize("args,words", [
    (["predict", "--speedup", "gemv=2", "--label", "../../escaped"], ["--label", "not a plain name"]),
    (["predict", "--speedup", "gemv=2", "--label", "{tmp}/escaped"], ["--label", "not a plain name"]),
    (["serve", "--dry-run", "--model", "/m", "--run-id", "../evil"], ["run id", "../evil"]),
    (["bench-all-tiers", "--model", "/m", "--run-id", "../evil"], ["run id", "../evil"]),
    (["bench-all-tiers", "--model", "/m", "--profile", "../evil"], ["--profile", "../evil"]),
])
def test_a_name_that_is_a_path_is_refused_not_shortened(tmp_path, args, words):
    """A label or run id holding a path would land outside its folder, or silently become its last part."""
    port = ["--port", str(free_port())] if args[0] == "bench-all-tiers" else []
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *(a.format(tmp=tmp_path) for a in args), *port)
    refused(r, *words)


# --- 2: archives ---------------------------------------------------------------------------------

BAD_MEMBERS = {
    "climbs out": member("../x"),
    "absolute": member(f"/tmp/forge-abs-{os.getpid()}"),
    "link out": member("l", tarfile.SYMTYPE, link="../../outside"),
    "absolute link": member("l", tarfile.SYMTYPE, link="/etc"),
    "device node": member("dev", tarfile.CHRTYPE),
    "fifo": member("fifo", tarfile.FIFOTYPE),
}


@pytest.mark.parametrize("bad", sorted(BAD_MEMBERS))
@pytest.mark.parametrize("to", [None, "new/sub"])
def test_unpack_refuses_a_bad_member_after_good_ones_before_writing(tmp_path, bad, to):
    run = tmp_path / "run"
    run.mkdir()
    tgz(run / "raw.tgz", [member("a.txt"), member("runs/up/4-8K.json"), BAD_MEMBERS[bad]])
    args = ["--to", str(tmp_path / to)] if to else []
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "unpack-run", str(run), *args)
    refused(r, "raw.tgz", repr(BAD_MEMBERS[bad][0].name))
    assert not (tmp_path / "new").exists() and not Path(f"/tmp/forge-abs-{os.getpid()}").exists()


def test_unpack_refuses_a_path_through_a_link_of_the_archive(tmp_path):
    """`d -> .` then `d/l -> ../x`: each looks inside, together they leave the folder."""
    run = tmp_path / "run"
    run.mkdir()
    tgz(run / "raw.tgz", [member("a.txt"), member("d", tarfile.SYMTYPE, link="."),
                          member("d/l", tarfile.SYMTYPE, link="../x")])
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "unpack-run", str(run))
    refused(r, "raw.tgz", "'d/l'", "under a link")


@pytest.mark.parametrize("damage", ["truncated", "not gzip"])
def test_unpack_of_a_damaged_archive_leaves_no_new_folder(tmp_path, damage):
    run = tmp_path / "run"
    run.mkdir()
    tgz(run / "raw.tgz", [member(f"runs/p/f{i}.json", body=os.urandom(20000)) for i in range(4)])
    data = (run / "raw.tgz").read_bytes()
    (run / "raw.tgz").write_bytes(data[: len(data) * 2 // 3] if damage == "truncated" else b"garbage" * 100)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "unpack-run", str(run), "--to", str(tmp_path / "new" / "copy"))
    refused(r, "raw.tgz", "cannot be read")


# --- 3, 7, 12, 16: result files and what predict, score and compare read ----------------------------

def test_predict_scores_and_shows_the_same_baseline(tmp_path):
    team = yaml.safe_load((ROOT / "configs" / "contest.yaml").read_text())["baselines"]["sets"]["team"]["tok_s"]
    r = forge(tmp_path, "predict", "--speedup", "gemv=1.45", "--baseline-name", "team", "--out", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()[:1] and line.split()[0] in TIERS}
    got = json.loads((tmp_path / "p" / "predict.json").read_text())
    for t in TIERS:
        tok, base, lift = float(rows[t][6]), float(rows[t][7]), float(rows[t][8].rstrip("%"))
        assert base == team[t], (t, rows[t])
        assert got["score"]["tiers"][t]["baseline_tok_s"] == team[t]
        assert lift == pytest.approx(100 * (tok / base - 1), abs=0.15)
    md = (tmp_path / "p" / "predict.md").read_text()
    assert "| team (configs/contest.yaml) tok/s |" in md and f"| {team['4-8K']:.2f} |" in md


RESULT_FAULTS = {
    "a list": (lambda d: [1, 2, 3], "a JSON list"),
    "string ttfts": (lambda d: {**d, "ttfts": ["0.1"] * len(d["ttfts"])}, "ttfts[0]"),
    "all-zero ttfts": (lambda d: {**d, "ttfts": [0.0] * len(d["ttfts"])}, "mean TTFT 0"),
    "string itls": (lambda d: {**d, "itls": ["x"] * len(d["itls"])}, "itls[0]"),
    "fewer ttfts": (lambda d: {**d, "ttfts": d["ttfts"][:-1]}, "'ttfts' has"),
}


@pytest.mark.parametrize("fault", sorted(RESULT_FAULTS))
def test_predict_reads_results_as_score_does(tmp_path, fault):
    run, base = copy_runs(tmp_path)
    fn, words = RESULT_FAULTS[fault]
    edit_json(run / "4-8K.json", fn)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--run", str(run), "--reference", str(base))
    refused(r, "4-8K.json", words)


@pytest.mark.parametrize("fault", ["a list", "fewer ttfts"])
def test_predict_e2e_reads_results_as_score_does(tmp_path, fault):
    e2e = tmp_path / "e2e"
    shutil.copytree(FIXTURE_RUNS / "base", e2e / "runs" / "upstream")
    shutil.copytree(FIXTURE_RUNS / "fast", e2e / "runs" / "fast")
    fn, words = RESULT_FAULTS[fault]
    edit_json(e2e / "runs" / "fast" / "8-16K.json", fn)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--e2e", str(e2e), "--out", str(tmp_path / "p"))
    refused(r, "8-16K.json", words)


def test_predict_e2e_without_the_reference_names_the_profiles_of_an_unpacked_folder(tmp_path):
    e2e = tmp_path / "e2e"
    shutil.copytree(FIXTURE_RUNS / "base", e2e / "runs" / "upstream")
    shutil.copytree(FIXTURE_RUNS / "fast", e2e / "runs" / "fast")
    (e2e / "summary.md").write_text("# run\n")
    assert forge(tmp_path, "pack-run", str(e2e), "--keep-raw").returncode == 0     # unpacked, raw.tgz beside
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--e2e", str(e2e), "--reference", "nope")
    refused(r, "no runs/nope/", "its profiles: fast, upstream")
    assert "packed" not in r.stderr


@pytest.mark.parametrize("damage,words,not_words", [
    ("hello", ["4-8K.json", "not valid JSON", "damaged, not cut short"], []),
    ('{"completed": 4, "failed": 0, "output_thr', ["4-8K.json", "not valid JSON, cut short"], ["damaged"]),
    (b"\xff\xfe{}", ["4-8K.json", "not UTF-8"], []),
])
def test_garbage_and_cut_short_json_are_told_apart(tmp_path, damage, words, not_words):
    run, base = copy_runs(tmp_path)
    p = run / "4-8K.json"
    p.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(base))
    refused(r, *words)
    assert not any(w in r.stderr for w in not_words), r.stderr


def test_a_baseline_with_zero_tok_s_names_its_tier_and_file(tmp_path):
    run, base = copy_runs(tmp_path)
    edit_json(base / "8-16K.json", lambda d: {**d, "output_throughput": 0.0})
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", str(run), "--baseline", str(base))
    refused(r, "tier 8-16K", "8-16K.json")


def test_score_of_an_e2e_results_folder_names_its_profiles(tmp_path):
    e2e = tmp_path / "e2e"
    shutil.copytree(FIXTURE_RUNS / "base", e2e / "runs" / "upstream")
    shutil.copytree(FIXTURE_RUNS / "fast", e2e / "runs" / "fast")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "score", "--run", str(e2e))
    refused(r, "has no result")
    assert "runs/<profile> (fast, upstream)" in r.stderr and "bench-all-tiers" not in r.stderr, r.stderr


@pytest.mark.parametrize("sides,words", [
    (lambda a, b: ["--a", a, a, "--b", b], ["side A", "same run folder"]),
    (lambda a, b: ["--a", a, "--b", b, f"{b}/../{Path(b).name}"], ["side B", "same run folder"]),
    (lambda a, b: ["--a", a, "--b", a], ["on both sides"]),
])
def test_compare_counts_each_run_once(tmp_path, sides, words):
    run, base = copy_runs(tmp_path)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "compare", *sides(str(run), str(base)))
    refused(r, *words)


def test_compare_says_when_neither_side_has_a_value(tmp_path):
    a, b = copy_runs(tmp_path)
    for d in (a, b):
        edit_json(d / "4-8K.json", lambda x: {**x, "completed": 0, "failed": x["completed"] + x["failed"],
                                              "errors": ["down"] * len(x["output_lens"])})
    r = forge(tmp_path, "compare", "--a", str(a), "--b", str(b))
    assert r.returncode == 0, r.stderr
    assert "4-8K TTFT P99 ms (no value on either side)" in r.stdout and "no run on side A" not in r.stdout, r.stdout


# --- 8, 9, 14, 15: option values --------------------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (["score", "--tok-s", "-1,1,1"], ["--tok-s", "'-1'", "not a finite positive tok/s"]),
    (["predict", "--ttft-s", "-1.55,3.5,6.28", "--tpot-ms", "45,45.7,46.9"], ["--ttft-s", "'-1.55'", "finite positive"]),
    (["predict", "--ttft-s", "1.55,3.5,6.28", "--tpot-ms", "-45,45.7,46.9"], ["--tpot-ms", "'-45'", "finite positive"]),
    (["compare", "--a", "x", "--b", "y", "--noise-pct", "-3"], ["--noise-pct", "-3"]),
])
def test_a_negative_number_reaches_our_refusal(tmp_path, args, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args)
    refused(r, *words)
    assert "expected one argument" not in r.stderr


def test_make_score_with_a_negative_what_if_gives_our_refusal(tmp_path):
    with writes_nothing(tmp_path):
        r = make(tmp_path, "score", "TOK_S=-1,1,1")
    refused(r, "--tok-s", "not a finite positive tok/s")


@pytest.mark.parametrize("verb", ["serve", "bench-all-tiers", "sweep"])
@pytest.mark.parametrize("port", ["0", "70000", "-5", "x"])
def test_a_port_outside_1_to_65535_is_refused(tmp_path, verb, port):
    args = {"serve": ["--dry-run", "--model", "/m"], "bench-all-tiers": ["--model", "/m"], "sweep": ["contest"]}[verb]
    with writes_nothing(tmp_path):
        r = forge(tmp_path, verb, *args, "--port", port)
    refused(r, "--port", "not a TCP port")


@pytest.mark.parametrize("args,words", [
    (["--tiers", "4-8K,bogus"], ["unknown tier(s) bogus"]),
    (["--tiers", ","], ["--tiers names no tier"]),
    (["--client", '"x'], ["--client", "unbalanced quote"]),
])
def test_bench_checks_its_options_before_asking_for_a_server(tmp_path, args, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "bench-all-tiers", "--model", "/m", "--port", str(free_port()), *args)
    refused(r, *words)
    assert "no server answers" not in r.stderr


@pytest.mark.parametrize("args,env,words", [
    (["serve", "--dry-run", "--model", "/m", "--vllm", '"x'], {}, ["--vllm", "unbalanced quote"]),
    (["bench-all-tiers", "--model", "/m"], {"FORGE_BENCH_CLIENT": "vllm 'x"}, ["FORGE_BENCH_CLIENT", "unbalanced"]),
])
def test_an_unbalanced_quote_in_a_command_is_refused(tmp_path, args, env, words):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, *args, **env)
    refused(r, *words)


def test_force_other_than_1_is_refused_not_ignored(tmp_path):
    run, base = copy_runs(tmp_path)
    assert forge(tmp_path, "score", "--run", str(run), "--baseline", str(base)).returncode == 0
    with writes_nothing(tmp_path):
        r = make(tmp_path, "score", f"RUN={run}", f"BASELINE={base}", "FORCE=yes")
    refused(r, "FORCE='yes'")


def _yaml(tmp_path: Path, name: str, text: "str | bytes") -> Path:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


@pytest.mark.parametrize("content,words", [
    (b"\xff\xfe", ["not UTF-8"]),
    ("", ["holds no speed-ups"]),
    ("gemv: 1.2\ngemv: 1.4\n", ["'gemv' is given twice"]),
    (None, ["is a folder, not a file"]),
])
def test_a_speedups_file_is_read_strictly(tmp_path, content, words):
    f = _yaml(tmp_path, "sp.yaml", content) if content is not None else tmp_path
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--speedups", str(f))
    refused(r, *words)


def test_a_component_given_twice_is_refused(tmp_path):
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "predict", "--speedup", "gemv=1.2", "--speedup", "gemv=1.4")
    refused(r, "gemv is given twice")


def test_a_profile_that_is_not_utf8_is_refused(tmp_path):
    prof = _yaml(tmp_path, "b.yaml", b"\xff\xfe")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--profile", str(prof), "--dry-run", "--model", "/m")
    refused(r, "b.yaml", "not UTF-8")


# --- 6, 11: the server record ------------------------------------------------------------------------

@pytest.mark.parametrize("content", ['{"pid": 12', "{}", "[1]", '{"pid": "x", "pgid": 1, "run_id": "r"}'])
def test_stop_with_a_damaged_server_record_says_so(tmp_path, content):
    state = tmp_path / "build" / "serve" / "server.json"
    state.parent.mkdir(parents=True)
    state.write_text(content)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "stop")
    refused(r, "server.json")
    assert "may still run" in r.stderr and "nothing to stop" not in r.stderr, r.stderr


def _model_dir(tmp_path: Path) -> Path:
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    return m


@pytest.mark.parametrize("launcher", ["exits", "missing"])
def test_a_failed_serve_leaves_no_run_record(tmp_path, launcher):
    m = _model_dir(tmp_path)
    vllm = f"{sys.executable} -c 'import sys; sys.exit(3)'" if launcher == "exits" else str(tmp_path / "no-vllm")
    status = git_status()
    r = forge(tmp_path, "serve", "--model", str(m), "--vllm", vllm, "--port", str(free_port()), "--run-id", "r1",
              "--timeout", "60")
    if launcher == "exits":             # the error quotes the server log's last lines below its one line
        assert r.returncode == 2 and "Traceback" not in r.stderr and "exited (code 3)" in r.stderr, r.stderr
    else:
        refused(r, "not installed")
    rdir = tmp_path / "runs" / "r1"
    # the server log a failed start names is all that is left (not tracked); nothing when nothing started
    assert sorted(p.name for p in rdir.iterdir()) == ["server.log"] if launcher == "exits" else not rdir.exists()
    assert not (tmp_path / "build" / "serve" / "server.json").exists()
    assert git_status() == status


# --- 5: patches ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("bad-inputs") / "proj", n_modules=10, n_patches=2)


FORBIDDEN_DIFF = ("--- a/vllm/v1/core/sched/scheduler.py\n+++ b/vllm/v1/core/sched/scheduler.py\n"
                  "@@ -1 +1 @@\n-A = 1\n+A = 2\n")
ALLOWED_DIFF = "--- a/vllm/config.py\n+++ b/vllm/config.py\n@@ -1 +1 @@\n-LINE_0 = 0\n+LINE_0 = 1\n"


@contextmanager
def patch_file(proj: dict, rel: str, text: str):
    p = proj["root"] / "patches" / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    try:
        yield p
    finally:
        p.unlink()
        if p.parent != proj["root"] / "patches":
            p.parent.rmdir()


def test_patches_lint_refuses_an_empty_series(proj):
    series = proj["root"] / "patches" / "series"
    kept = series.read_text()
    series.write_text("# nothing yet\n")
    try:
        r = run_in(proj, "patches-lint")
    finally:
        series.write_text(kept)
    refused(r, "patches/series lists no patch")


@pytest.mark.parametrize("where", ["stray.patch", "base/stand-in.patch", "base/deeper/x.diff"])
def test_patches_lint_checks_every_patch_file_for_forbidden_paths(proj, where):
    with patch_file(proj, where, FORBIDDEN_DIFF):
        r = run_in(proj, "patches-lint")
    refused(r, "1 patch(es) failed the lint")
    assert f"patches/{where}: touches vllm/v1/core/sched/scheduler.py" in r.stdout, r.stdout


def test_patches_lint_does_not_demand_a_subfolder_patch_in_the_series(proj):
    with patch_file(proj, "base/stand-in.patch", ALLOWED_DIFF):
        r = run_in(proj, "patches-lint")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 other patch file(s)" in r.stderr and "stand-in.patch" not in r.stderr, r.stderr


# --- 13, 16: profiles ----------------------------------------------------------------------------

def test_a_profile_file_extending_its_namesake_is_no_cycle(tmp_path):
    prof = _yaml(tmp_path, "fast.yaml", "description: my fast\nextends: fast\n")
    r = forge(tmp_path, "serve", "--profile", str(prof), "--dry-run", "--model", "/m")
    assert r.returncode == 0 and "cycle" not in r.stderr, r.stderr
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"description: a\nextends: {b}\n")
    b.write_text(f"description: b\nextends: {a}\n")
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "serve", "--profile", str(a), "--dry-run", "--model", "/m")
    refused(r, "cycle")


def test_report_names_a_profile_files_own_path(tmp_path):
    prof = _yaml(tmp_path, "x.yaml", "description: mine\nextends: contest\n")
    r = forge(tmp_path, "report", "--profile", str(prof), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    chain = next(x for x in (tmp_path / "out" / "env-vars.md").read_text().splitlines() if x.startswith("Profile chain"))
    assert f"`{prof}`" in chain and "configs/serve/x.yaml" not in chain and "`configs/serve/contest.yaml`" in chain


# --- 17, 19: help and the Makefile -----------------------------------------------------------------

def _verbs() -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    from forge import cli
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.dest == "verb")
    helps = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in p.epilog.splitlines()
             if line.startswith("  ") and len(line.split(None, 1)) == 2}
    return {name: (parser, helps.get(name)) for name, parser in sub.choices.items()}


def test_every_verb_is_described_in_its_help():
    verbs = _verbs()
    assert len(verbs) > 30
    for name, (parser, short) in verbs.items():
        assert short and parser.description and parser.description.strip(), name
        assert f"forge {name}" in parser.format_help()
    r = subprocess.run([sys.executable, "-m", "forge", "patches-lint", "--help"], cwd=ROOT, env=forge_env(ROOT),
                       capture_output=True, text=True)
    assert "Check every patch's review record" in r.stdout, r.stdout


def test_make_help_and_forge_help_say_the_same():
    """A target that runs the verb of its name describes it with the verb's own one-line help (and adds
    its make variables)."""
    verbs = _verbs()
    text = (ROOT / "Makefile").read_text()
    checked = 0
    for m in re.finditer(r"^([a-zA-Z][\w-]*):[^\n#]*## (.*)\n((?:\t.*\n)*)", text, re.M):
        target, desc, recipe = m.groups()
        v = re.search(r"\$\((?:FORGE|BOOT)\) ([\w-]+)", recipe)
        if not v or v.group(1) != target:
            continue
        assert verbs[target][1] in desc, (target, desc, verbs[target][1])
        checked += 1
    assert checked > 25


def test_the_makefile_header_lists_every_variable():
    text = (ROOT / "Makefile").read_text()
    header = " ".join(x.lstrip("# ") for x in text.split("\n\n", 1)[0].splitlines())
    listed = set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", header.split("Variables:", 1)[1]))
    used = set(re.findall(r"\$\(([A-Z][A-Z0-9_]*)\)", text)) | {"THREEWAY"}       # THREEWAY: read by forge tree
    internal = {"FORGE", "BOOT", "VENV", "CURDIR", "MAKEFLAGS", "SHELL"}
    assert used - internal <= listed, sorted(used - internal - listed)


def test_make_predict_takes_out_and_label(tmp_path):
    r = make(tmp_path, "predict", "SPEEDUP=gemv=2", f"OUT={tmp_path / 'o'}", "LABEL=mine")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o" / "predict.json").read_text())["label"] == "mine"


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_make_check_refuses_a_worker_count_that_is_not_one_or_more(tmp_path, value):
    with writes_nothing(tmp_path):
        r = make(tmp_path, "check", f"WORKERS={value}")
    refused(r, "--workers", f"{value!r} is not a count")


def test_make_compare_without_sides_gives_our_refusal(tmp_path):
    with writes_nothing(tmp_path):
        r = make(tmp_path, "compare")
    refused(r, "side A has no run")
    assert "usage:" not in r.stderr


# --- 18, 20: the documented examples and the image's description -------------------------------------

def test_the_readme_predict_examples_run_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Predicting the DCU score", 1)[1]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    lines = [x.split("#", 1)[0].strip() for x in block.strip().splitlines()]
    assert len(lines) == 3 and all(x.startswith("make predict ") for x in lines), lines
    shown = []
    for line in lines:
        args = [a.replace("<run>", Path(HEAD_CHECK).name).replace('"', "") for a in
                re.findall(r'\S+="[^"]*"|\S+', line)[2:]]
        r = make(tmp_path, "predict", *args)
        assert r.returncode == 0, (line, r.stderr)
        shown.append(re.findall(r"predicted score (\S+)", r.stdout))
    stated = re.search(r"it gives (\S+) \(exact", section).group(1)
    assert shown[2] == [stated], (shown[2], stated)


def test_the_image_description_names_every_change_of_the_series():
    label = re.search(r'image\.description="([^"]*)"', (ROOT / "Dockerfile.rocm").read_text()).group(1)
    named = {"int8-kv": "int8 KV cache", "decode": "split-KV decode", "prefill": "prefill", "gemv": "GEMV",
             "tuned": "per-device tuned table", "routes": "compile-safe routes",
             "custom-ar": "custom all-reduce only over XGMI-linked cards",
             "switches": "switch values checked by one validator",
             "build": None}          # build: compiles the others' kernels into vllm._C
    series = [x.strip() for x in (ROOT / "patches" / "series").read_text().splitlines()
              if x.strip() and not x.startswith("#")]
    for name in series:
        subject = next(x for x in (ROOT / "patches" / name).read_text().splitlines() if x.startswith("Subject:"))
        topic = re.sub(r"^Subject:\s*(\[PATCH[^\]]*\]\s*)?", "", subject).split(":", 1)[0]
        assert topic in named, f"{name}: topic {topic!r}: name it in the image description and here"
        assert named[topic] is None or named[topic] in label, (topic, label)


# --- calibration ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["calibrate", "--families", "gemv,nope"], ["--families", "unknown nope"]),
    (["calibrate", "--redo", "nope"], ["--redo", "unknown family 'nope'"]),
    (["calibrate", "--python", "/nonexistent/python3"], ["--python", "not an executable file"]),
    (["calibrate", "--out", ""], ["--out"]),
    (["predict", "--calibration", "tests"], ["no calibration.json"]),
    (["predict", "--check-e2e", "tests"], ["--check-e2e goes with --calibration"]),
])
def test_calibration_inputs_are_refused(tmp_path, args, words):
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, *args), *words)


def test_a_calibration_folder_that_is_not_a_report_is_named(tmp_path):
    cal = tmp_path / "cal"
    cal.mkdir()
    (cal / "calibration.json").write_text('{"selection": 3}')
    with writes_nothing(tmp_path):
        refused(forge(tmp_path, "predict", "--calibration", str(cal)), "not a calibration report")
