"""Patched tree + patch tooling on a tiny fake upstream: incremental, no-op reruns, failures that
name patch/file/hunk, refresh round trip, lint of review records and forbidden paths."""

import shutil
import subprocess

import pytest
from pipeline_fixtures import REVIEW, make_patch, make_sdist, upstream_cfg

from forge.builder import patches, tree
from forge.errors import ForgeError
from forge.recipe import patchfile


@pytest.fixture
def env(tmp_path, monkeypatch):
    tb, sha, th = make_sdist(tmp_path)
    pristine = tmp_path / "ex" / "vllm-0.18.1"
    cfg = upstream_cfg(sha, th)
    monkeypatch.setattr(tree.config, "upstream", lambda: cfg)
    monkeypatch.setattr(tree.fetch, "ensure_source", lambda source="auto": pristine)
    root = tmp_path / "repo"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "k.py").write_text("def kernel():\n    return 42\n")
    (root / "kernels" / "overlay.yaml").write_text("files:\n  - src: kernels/k.py\n    dst: pkg/ops/k.py\n")
    monkeypatch.setattr(tree, "ROOT", root)
    monkeypatch.setattr(tree, "KERNELS", root / "kernels")
    pdir = root / "patches"
    pdir.mkdir()
    (pdir / "series").write_text("")
    # scratch git copy of pristine to author patches against
    work = tmp_path / "author"
    shutil.copytree(pristine, work)
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(["git", "-C", str(work), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"],
                   check=True)
    return {"pristine": pristine, "root": root, "pdir": pdir, "work": work, "tree": tmp_path / "build" / "vllm"}


def add_patch(env, name, rel, old, new, subject="pkg: change", body=REVIEW):
    text = make_patch(env["work"], rel, old, new, subject, body)
    (env["pdir"] / name).write_text(text)
    with open(env["pdir"] / "series", "a") as f:
        f.write(name + "\n")


def log(t):
    return tree.git_out(t, "log", "--format=%s").splitlines()


def test_tree_layers_and_noop_rerun(env):
    add_patch(env, "one.patch", "pkg/config.py", "LINE_3 = 3", "LINE_3 = 33", "pkg: first")
    add_patch(env, "two.patch", "pkg/config.py", "LINE_30 = 30", "LINE_30 = 300", "pkg: second")
    st = tree.build_tree(env["tree"], patches_dir=env["pdir"])
    assert log(env["tree"]) == ["pkg: second", "pkg: first", "forge kernel overlay (kernels/overlay.yaml)",
                                f"upstream vLLM 0.18.1 (sdist sha256 {tree.config.upstream()['sdist']['sha256']})"]
    assert (env["tree"] / "pkg" / "ops" / "k.py").read_text().endswith("return 42\n")
    assert "LINE_30 = 300" in (env["tree"] / "pkg" / "config.py").read_text()
    head = st["head"]
    st2 = tree.build_tree(env["tree"], patches_dir=env["pdir"])
    assert st2["head"] == head and len(log(env["tree"])) == 4
    # deterministic: a fresh tree from the same inputs has the same commits
    other = env["tree"].parent / "other"
    assert tree.build_tree(other, patches_dir=env["pdir"])["head"] == head


def test_failing_patch_named_with_file_and_hunk_and_tree_left_at_last_good(env):
    add_patch(env, "one.patch", "pkg/config.py", "LINE_3 = 3", "LINE_3 = 33", "pkg: first")
    add_patch(env, "two.patch", "pkg/config.py", "LINE_30 = 30", "LINE_30 = 300", "pkg: second")
    st = tree.build_tree(env["tree"], patches_dir=env["pdir"])
    good = st["patches"][0][2]
    p = env["pdir"] / "two.patch"
    p.write_text(p.read_text().replace(" LINE_28 = 28", " LINE_28 = 2800"))   # corrupt a context line
    with pytest.raises(ForgeError) as e:
        tree.build_tree(env["tree"], patches_dir=env["pdir"])
    msg = str(e.value)
    assert "two.patch" in msg and "pkg/config.py" in msg and "hunk #1" in msg
    assert tree.git_out(env["tree"], "rev-parse", "HEAD") == good
    assert tree.git_out(env["tree"], "status", "--porcelain") == ""


def test_unexported_work_is_never_discarded(env):
    tree.build_tree(env["tree"], patches_dir=env["pdir"])
    f = env["tree"] / "pkg" / "config.py"
    f.write_text(f.read_text() + "WIP = 1\n")
    with pytest.raises(ForgeError, match="uncommitted"):
        tree.build_tree(env["tree"], patches_dir=env["pdir"])
    tree.git(env["tree"], "commit", "-qam", "wip")
    with pytest.raises(ForgeError, match="patches-refresh"):
        tree.build_tree(env["tree"], patches_dir=env["pdir"])
    assert "WIP = 1" in f.read_text()
    tree.build_tree(env["tree"], patches_dir=env["pdir"], force=True)
    assert "WIP = 1" not in f.read_text()


def test_refresh_round_trip_preserves_message_and_names(env, monkeypatch):
    add_patch(env, "first-change.patch", "pkg/config.py", "LINE_3 = 3", "LINE_3 = 33", "pkg: first")
    tree.build_tree(env["tree"], patches_dir=env["pdir"])
    f = env["tree"] / "pkg" / "config.py"
    f.write_text(f.read_text().replace("LINE_20 = 20", "LINE_20 = 21"))
    tree.git(env["tree"], "commit", "-qam", "pkg: new work\n\n" + REVIEW)
    names = patches.refresh(env["tree"], env["pdir"])
    assert names == ["first-change.patch", "pkg_new_work.patch"]
    p = patchfile.parse(env["pdir"] / "pkg_new_work.patch")
    assert p.subject == "pkg: new work" and p.sections()["Evidence"] == "test_x."
    # the tree is in sync with the exported series: no rebuild, and a rebuild elsewhere matches it
    head = tree.git_out(env["tree"], "rev-parse", "HEAD^{tree}")
    tree.build_tree(env["tree"], patches_dir=env["pdir"])
    other = env["tree"].parent / "other"
    tree.build_tree(other, patches_dir=env["pdir"])
    assert tree.git_out(other, "rev-parse", "HEAD^{tree}") == head
    # idempotent: a second refresh rewrites nothing
    before = {p.name: p.read_text() for p in env["pdir"].iterdir()}
    patches.refresh(env["tree"], env["pdir"])
    assert before == {p.name: p.read_text() for p in env["pdir"].iterdir()}


RULES = {"scheduler": {"text": "Any change to the scheduler is forbidden."}}
FORBIDDEN = [{"glob": "pkg/sched/**", "rule": "scheduler"}]


def test_lint_requires_review_record_and_refuses_forbidden_paths(env):
    add_patch(env, "ok.patch", "pkg/config.py", "LINE_3 = 3", "LINE_3 = 33", "pkg: ok")
    add_patch(env, "thin.patch", "pkg/config.py", "LINE_5 = 5", "LINE_5 = 55", "pkg: thin",
              body="Why: x\nWhat: y\n")
    add_patch(env, "sched.patch", "pkg/sched/scheduler.py", "return 1", "return 2", "pkg: sched")
    lint = {n: patches.lint_patch(patchfile.parse(env["pdir"] / n), FORBIDDEN, RULES)
            for n in ("ok.patch", "thin.patch", "sched.patch")}
    assert lint["ok.patch"] == []
    assert any("'Risk:'" in p for p in lint["thin.patch"]) and any("'Rule check:'" in p for p in lint["thin.patch"])
    assert any("pkg/sched/scheduler.py" in p and "forbidden" in p and "scheduler is forbidden" in p
               for p in lint["sched.patch"])


def test_lint_refuses_new_files(env):
    (env["work"] / "pkg" / "new.py").write_text("x = 1\n")
    subprocess.run(["git", "-C", str(env["work"]), "add", "pkg/new.py"], check=True)
    text = make_patch(env["work"], "README", "fake", "real", "pkg: new file")
    (env["pdir"] / "new.patch").write_text(text)
    problems = patches.lint_patch(patchfile.parse(env["pdir"] / "new.patch"), FORBIDDEN, RULES)
    assert any("creates pkg/new.py" in p and "overlay" in p for p in problems)


def test_lint_refuses_an_overlay_file_in_a_forbidden_path(env, monkeypatch):
    """A kernel the overlay adds under a forbidden path changes that code as much as a patch would."""
    (env["root"] / "kernels" / "overlay.yaml").write_text(
        "files:\n  - src: kernels/k.py\n    dst: pkg/ops/k.py\n  - src: kernels/k.py\n    dst: pkg/sched/helper.py\n")
    problems = patches.lint_overlay(tree.overlay_entries(), FORBIDDEN, RULES)
    assert len(problems) == 1 and "files[1].dst" in problems[0] and "pkg/sched/helper.py" in problems[0]
    assert "scheduler is forbidden" in problems[0]
    for spelled in ("./pkg/sched/x.py", "pkg//sched/x.py", "pkg/ops/../sched/./x.py"):
        assert patches.lint_overlay([{"src": "kernels/k.py", "dst": spelled}], FORBIDDEN, RULES), spelled
    monkeypatch.setattr(patches, "load_contest", lambda: {"forbidden_paths": FORBIDDEN, "rules": RULES})
    add_patch(env, "one.patch", "pkg/config.py", "LINE_3 = 3", "LINE_3 = 33", "pkg: first")
    with pytest.raises(ForgeError, match="kernels/overlay.yaml adds 1 file"):
        patches.lint(env["pdir"])
    (env["root"] / "kernels" / "overlay.yaml").write_text("files:\n  - src: kernels/k.py\n    dst: pkg/ops/k.py\n")
    assert patches.lint(env["pdir"]) == 0


def test_clean_keeps_unexported_work_and_a_running_servers_record(env, monkeypatch):
    """`make clean` removes build/ only when nothing there would be lost for good (FORCE=1: anyway)."""
    import argparse

    from forge import devenv
    from forge.run import server_record
    build = env["tree"].parent
    monkeypatch.setattr(devenv, "TREE", env["tree"])
    monkeypatch.setattr(devenv, "BUILD", build)
    monkeypatch.setattr(devenv, "DIST", build.parent / "dist")
    monkeypatch.delenv("FORCE", raising=False)
    tree.build_tree(env["tree"], patches_dir=env["pdir"])
    f = env["tree"] / "pkg" / "config.py"
    f.write_text(f.read_text() + "WIP = 1\n")
    with pytest.raises(ForgeError, match="uncommitted") as e:
        devenv.cmd_clean(argparse.Namespace(force=False))
    assert "make clean FORCE=1" in str(e.value) and "WIP = 1" in f.read_text()
    tree.git(env["tree"], "commit", "-qam", "wip")
    with pytest.raises(ForgeError, match="not in patches/"):
        devenv.cmd_clean(argparse.Namespace(force=False))
    tree.git(env["tree"], "reset", "-q", "--hard", "HEAD~1")            # back to what patches/ builds
    (env["tree"] / "pkg" / "new_kernel.py").write_text("x = 1\n")        # new work git does not track yet
    with pytest.raises(ForgeError, match="new_kernel.py"):
        devenv.cmd_clean(argparse.Namespace(force=False))
    (env["tree"] / "pkg" / "new_kernel.py").unlink()
    state = env["tree"] / ".git" / tree.STATE
    saved = state.read_bytes()
    state.unlink()                                                      # a tree with no record of its build
    with pytest.raises(ForgeError, match="no record"):
        devenv.cmd_clean(argparse.Namespace(force=False))
    state.write_bytes(saved)
    monkeypatch.setattr(server_record, "running_server", lambda: {"pid": 4242, "run_id": "r1"})
    with pytest.raises(ForgeError, match="pid 4242") as e:
        devenv.cmd_clean(argparse.Namespace(force=False))
    assert "make stop" in str(e.value) and env["tree"].is_dir()
    monkeypatch.setattr(server_record, "running_server", lambda: None)
    assert devenv.cmd_clean(argparse.Namespace(force=False)) == 0 and not build.exists()
    tree.build_tree(env["tree"], patches_dir=env["pdir"])
    f.write_text(f.read_text() + "WIP = 1\n")
    monkeypatch.setenv("FORCE", "1")
    assert devenv.cmd_clean(argparse.Namespace(force=False)) == 0 and not build.exists()


def test_series_names_missing_file(env):
    (env["pdir"] / "series").write_text("# comment\nmissing.patch\n")
    with pytest.raises(ForgeError, match="missing.patch"):
        patchfile.read_series(env["pdir"])


def test_overlay_may_not_replace_upstream_files(env):
    (env["root"] / "kernels" / "overlay.yaml").write_text("files:\n  - src: kernels/k.py\n    dst: pkg/config.py\n")
    with pytest.raises(ForgeError, match="exists upstream"):
        tree.build_tree(env["tree"], patches_dir=env["pdir"])


def test_refresh_normalizes_identity_and_date(env):
    tree.build_tree(env["tree"], patches_dir=env["pdir"])
    f = env["tree"] / "pkg" / "config.py"
    f.write_text(f.read_text().replace("LINE_9 = 9", "LINE_9 = 99"))
    tree.git(env["tree"], "commit", "-qam", "pkg: x\n\n" + REVIEW,
             env={"GIT_AUTHOR_NAME": "Some Very Long Machine Identity Name That Folds",
                  "GIT_AUTHOR_EMAIL": "someone@machine.example", "GIT_AUTHOR_DATE": "2030-05-05T05:05:05Z"})
    patches.refresh(env["tree"], env["pdir"])
    text = (env["pdir"] / "pkg_x.patch").read_text()
    head = text.split("\n\n", 1)[0]
    assert "machine.example" not in text and "Machine Identity" not in text
    assert patches.PATCH_AUTHOR in head.splitlines() and patches.PATCH_DATE in head.splitlines()
    assert patchfile.parse(env["pdir"] / "pkg_x.patch").subject == "pkg: x"


def test_refresh_keeps_blank_context_lines(env):
    tree.build_tree(env["tree"], patches_dir=env["pdir"])
    f = env["tree"] / "pkg" / "config.py"
    lines = f.read_text().splitlines(keepends=True)
    lines.insert(9, "\n")                        # the hunk's last context line is a blank line: " "
    f.write_text("".join(lines))
    tree.git(env["tree"], "commit", "-qam", "pkg: blank\n\n" + REVIEW)
    f.write_text(f.read_text().replace("LINE_6 = 6", "LINE_6 = 66"))
    tree.git(env["tree"], "commit", "-qam", "pkg: edit near blank\n\n" + REVIEW)
    patches.refresh(env["tree"], env["pdir"])
    other = env["tree"].parent / "other"
    tree.build_tree(other, patches_dir=env["pdir"])
    assert tree.git_out(other, "rev-parse", "HEAD^{tree}") == tree.git_out(env["tree"], "rev-parse", "HEAD^{tree}")


def test_overlay_commit_takes_only_overlay_files(env):
    tree.build_tree(env["tree"], patches_dir=env["pdir"])
    (env["tree"] / "stray.egg-info").write_text("build output\n")
    (env["root"] / "kernels" / "k.py").write_text("def kernel():\n    return 43\n")
    tree.build_tree(env["tree"], patches_dir=env["pdir"])
    files = tree.git_out(env["tree"], "show", "--name-only", "--format=", tree.OVERLAY_REF).split()
    assert files == ["pkg/ops/k.py"]


def test_tree_without_state_is_not_deleted(env):
    env["tree"].mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(env["tree"])], check=True)
    (env["tree"] / "precious.txt").write_text("work\n")
    with pytest.raises(ForgeError, match="no record"):
        tree.build_tree(env["tree"], patches_dir=env["pdir"])
    assert (env["tree"] / "precious.txt").exists()


def test_failed_patch_then_fix_in_tree_is_not_reset(env):
    """After a patch fails the tree is not 'pending': the user's fix there is kept by the rerun's checks."""
    add_patch(env, "one.patch", "pkg/config.py", "LINE_3 = 3", "LINE_3 = 33", "pkg: first")
    p = env["pdir"] / "one.patch"
    p.write_text(p.read_text().replace(" LINE_1 = 1", " LINE_1 = 100"))
    with pytest.raises(ForgeError, match="one.patch"):
        tree.build_tree(env["tree"], patches_dir=env["pdir"])
    assert "pending" not in tree.read_state(env["tree"])
    f = env["tree"] / "pkg" / "config.py"
    f.write_text(f.read_text() + "FIX = 1\n")
    with pytest.raises(ForgeError, match="uncommitted"):
        tree.build_tree(env["tree"], patches_dir=env["pdir"])
    assert "FIX = 1" in f.read_text()


def test_interrupted_patch_step_is_resumed(env):
    """A run killed inside `git am` (a lock and a half-applied mailbox left behind) resumes."""
    add_patch(env, "one.patch", "pkg/config.py", "LINE_3 = 3", "LINE_3 = 33", "pkg: first")
    want = tree.build_tree(env["tree"], patches_dir=env["pdir"])["head"]
    t = env["tree"]
    st = tree.read_state(t)
    # what a kill in the middle of applying the patch leaves behind
    st.update(pending="build", head=st["overlay_commit"], patches=[])
    tree.write_state(t, st)
    (t / "pkg" / "config.py").write_text("half written\n")
    (t / ".git" / "index.lock").write_text("")
    assert tree.build_tree(t, patches_dir=env["pdir"])["head"] == want
    assert tree.git_out(t, "status", "--porcelain") == "" and "pending" not in tree.read_state(t)


def test_export_refuses_a_bad_into_before_building_anything(tmp_path, monkeypatch):
    """`forge export --into <not a directory>` says so at once; the tree (minutes on a fresh machine)
    is not built first."""
    from forge.ship import export

    def no_build(*a, **k):
        raise AssertionError("the tree was built before the argument was checked")
    monkeypatch.setattr(export.tree, "build_tree", no_build)
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(ForgeError, match="not a directory|a file, not a folder"):
            export.export(tmp_path / "out", into=bad)
    assert not (tmp_path / "out").exists()


def test_an_overlay_pattern_stands_for_each_file_it_matches(env):
    """The per-device tables ride the overlay as a pattern: one entry per matching file, in name order,
    into the folder the entry names; a pattern matching nothing adds nothing; a pattern needs a folder."""
    tuned = env["root"] / "configs" / "tuned"
    tuned.mkdir(parents=True)
    overlay = env["root"] / "kernels" / "overlay.yaml"
    overlay.write_text("files:\n  - src: kernels/k.py\n    dst: pkg/ops/k.py\n"
                       "  - src: configs/tuned/*.json\n    dst: pkg/tuned/\n")
    assert tree.overlay_entries() == [{"src": "kernels/k.py", "dst": "pkg/ops/k.py"}]
    (tuned / "b.json").write_text("{}")
    (tuned / "a.json").write_text("{}")
    (tuned / "notes.txt").write_text("not a table")
    assert tree.overlay_entries()[1:] == [{"src": "configs/tuned/a.json", "dst": "pkg/tuned/a.json"},
                                          {"src": "configs/tuned/b.json", "dst": "pkg/tuned/b.json"}]
    overlay.write_text("files:\n  - src: configs/tuned/*.json\n    dst: pkg/tuned\n")
    with pytest.raises(ForgeError, match="a pattern's destination is a folder ending in '/'"):
        tree.overlay_entries()
    overlay.write_text("files:\n  - src: ../elsewhere/*.json\n    dst: pkg/tuned/\n")
    with pytest.raises(ForgeError, match="relative paths inside the project"):
        tree.overlay_entries()
