"""`make submission`: the repository a team pushes to the contest's GitLab, where the platform runs
`python setup.py bdist_wheel` and `pip install dist/vllm-*.whl --no-deps` without network, then the
organizers' start script.

A git repository (dist/submission/, or --into an empty or new directory) whose history is:

  1. the base: the vendor's vLLM tree (VENDOR_SRC), or, without one, CI's stand-in for it (the
     sdist plus patches/base/vendor-standin.patch; its message and SUBMISSION.md say so: a stand-in
     submission is for checking the flow, never for pushing)
  2. our kernel files (kernels/overlay.yaml)
  3. one commit per patch of patches/series, its message the patch's review record
  4. the documents: ENVIRONMENT.md (Art. 12), OPTIMIZATION.md (Art. 13), SUBMISSION.md

then a pre-flight of what the platform runs, as far as this machine can: setup.py's version and
extension list for a ROCm/DTK build (setupprobe.py), the offline check, the series on the base
(patches-check) against the repository's code, the contest's forbidden paths, the defaults-on
check of the environment variables, and no build/ or dist/ folder in it. Its record goes to
build/submission-preflight.json.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import shlex
import shutil
from pathlib import Path

from .. import ui
from ..builder import basecheck, bases, patches, tree
from ..contest import profiles, rounds
from ..contest.rules import load_contest, organizers_argv
from ..errors import ForgeError
from ..paths import BUILD, DIST, ROOT, rel, write_atomic
from ..recipe import provenance
from ..run import final_pick
from . import contest_docs

MARKER = "forge-submission.json"        # inside .git: this repository was written by `make submission`
PREFLIGHT = BUILD / "submission-preflight.json"


def target_dir(into: str | None) -> Path:
    """Where to write: --into must be an empty or new directory; the default dist/submission may
    only replace a repository written there earlier by this command."""
    t = Path(into).expanduser().resolve() if into else (DIST / "submission").resolve()
    if t.exists() and not t.is_dir():
        raise ForgeError(f"{t}: exists and is not a directory", hint="give an empty or new directory")
    if t.is_dir() and any(t.iterdir()) and not (into is None and (t / ".git" / MARKER).is_file()):
        raise ForgeError(f"{t}: not empty", hint="give an empty or new directory (--into DIR); the submission "
                                                  "is a new repository: push it to your fork from there")
    if t.is_relative_to(ROOT.resolve()) and not t.is_relative_to(DIST.resolve()):
        raise ForgeError(f"{t}: inside this project's checkout", hint="write it under dist/ (the default) or "
                                                                      "outside the checkout")
    return t


def check_places(target: Path) -> None:
    """Every place the submission writes, checked before anything is built or written: found at its
    write, a folder where the pre-flight record goes left the new repository beside the target (and no
    record). The repository is written beside `target` (.<name>.partial), then renamed to it."""
    work = target.parent / f".{target.name}.partial"
    blocked = None
    if PREFLIGHT.is_dir() and not PREFLIGHT.is_symlink():
        blocked = (PREFLIGHT, "a folder", "its pre-flight record (a file)")
    elif work.is_symlink() or work.exists() and not work.is_dir():
        blocked = (work, "a file" if work.exists() else "a link", f"the repository before it becomes {target.name}")
    for path, what in ((PREFLIGHT, "its pre-flight record"), (target, "the repository")):
        above = next((a for a in path.parents if a.exists()), None)
        if blocked is None and above is not None and not above.is_dir():
            blocked = (above, "a file", f"a folder for {what}")
        elif blocked is None and above is not None and not os.access(above, os.W_OK | os.X_OK):
            blocked = (above, "a folder it may not write to", what)
    if blocked is not None:
        path, kind, what = blocked
        raise ForgeError(f"{rel(path)}: {kind} where the submission writes {what}; nothing was written",
                         hint="move it away" + ("" if path == PREFLIGHT or PREFLIGHT.is_relative_to(path) else
                                                ", or give another --into (make submission INTO=...)"))


def _commit_docs(repo: Path, docs: dict[str, str], base: str) -> str:
    for name, text in docs.items():
        (repo / name).write_text(text)
    msg = ("Submission documents: environment variables (rules Art. 12) and optimizations (rules Art. 13)\n\n"
           "ENVIRONMENT.md: every environment variable the changes read, the value this submission runs with "
           "(the default in code; none needs to be set), what it does and why.\nOPTIMIZATION.md: the methods "
           "(each change's review record), each optimization's measured contribution and a summary table.\n"
           "SUBMISSION.md: what this repository is, how the platform builds and serves it"
           + (" (a STAND-IN base: not for pushing)." if base == "standin" else "."))
    tree.git(repo, "add", "-f", "--", *docs)
    tree.git(repo, "commit", "-q", "--no-verify", "-m", msg)
    return tree.git_out(repo, "rev-parse", "HEAD")


def submission_md(base: str, state: dict, contest: dict) -> str:
    argv = organizers_argv(contest, contest["server"]["start_script"]["model_placeholder"])
    head = ("**STAND-IN BASE: not for pushing.** This repository starts from CI's stand-in for the vendor tree "
            "(the vLLM 0.18.1 sdist plus our re-creation of the vendor's seven build changes), written where no "
            "vendor checkout was given. For the contest, run `make submission VENDOR_SRC=/path/to/vllm_cscc`."
            if base == "standin" else
            "This repository is the vendor's vLLM tree (OpenDAS vllm_cscc, branch v0.18.1) with our changes on top.")
    return "\n".join([
        "<!-- Generated by `forge submission` (scripts/forge/ship/submission.py); do not edit. -->", "",
        "# vLLM 0.18.1 for Qwen3.5-27B on Hygon DCU: contest submission", "", head, "",
        "## History", "",
        "1. the base (its commit message says which and how it was verified)",
        "2. our kernel files (one commit; the list is in its message)",
        f"3. one commit per change ({len(state['patches'])}), each message the change's review record",
        "4. these documents", "",
        "## What the platform runs", "", "```",
        "python setup.py bdist_wheel            # offline: no download is reachable for HIP",
        "pip install dist/vllm-*.whl --no-deps  # vllm 0.18.1+das.dtk<DTK release>",
        shlex.join(argv).replace("'$MODEL_DIR'", "$MODEL_DIR") + "   # the organizers' start script", "```", "",
        "Our compiled kernels are built into vllm._C by that same `setup.py bdist_wheel`; every speed-up is on by "
        "default (ENVIRONMENT.md), so the organizers' start script runs the submission as measured.", "",
        "## Push", "", "```", "git remote add contest <your fork on the contest's GitLab>",
        "git push contest HEAD:<the branch the platform builds>", "```", ""])


def _forbidden_touches(repo: Path, first: str, code: str) -> list[str]:
    c = load_contest()
    names = tree.git_out(repo, "diff", "--name-only", first, code).splitlines()
    return [f"{n}: forbidden by the contest ({fp['glob']}): \"{c['rules'][fp['rule']]['text']}\""
            for n in names for fp in c["forbidden_paths"] if fnmatch.fnmatchcase(n, fp["glob"])]


def preflight(repo: Path, base: str, code_commit: str, first: str) -> list[dict]:
    """What the platform runs, as far as this machine can; [{check, ok, detail}]."""
    out = [{"check": name, "ok": ok, "detail": detail} for name, ok, detail in basecheck.check(repo)]
    checked = patches.check(which=[base])[base]
    ours = tree.git_out(repo, "rev-parse", f"{code_commit}^{{tree}}")
    out.append({"check": "patch check", "ok": checked == ours,
                "detail": f"the series on the {base} base gives tree {checked[:12]}; the repository's code commit "
                          f"holds {ours[:12]}"})
    bad = _forbidden_touches(repo, first, code_commit)
    out.append({"check": "forbidden paths", "ok": not bad, "detail": "; ".join(bad) or
                "the changes touch no path the contest forbids (and every patch carries its review record)"})
    c = load_contest()
    probs = contest_docs.defaults_problems(profiles.load_profile("contest", c), contest_docs.series_env_vars())
    out.append({"check": "defaults on", "ok": not probs, "detail": "; ".join(probs) or
                "the contest profile sets every variable to its default in code: it runs as measured with none set"})
    out.append(_tuned_tables_check(repo))
    tracked = tree.git_out(repo, "ls-files").splitlines()
    outputs = sorted({p.split("/")[0] for p in tracked if p.split("/")[0] in ("build", "dist")} |
                     {d for d in ("build", "dist") if (repo / d).exists()})
    out.append({"check": "no build outputs", "ok": not outputs, "detail": f"found {', '.join(outputs)}/" if outputs
                else "no build/ or dist/ folder (a stale build/lib is reused by bdist_wheel)"})
    return out


def _tuned_tables_check(repo: Path) -> dict:
    """Every per-device table the repository ships, read by the loader it ships (the same code the server
    runs): valid, and no machine path or unhashed dirty commit in its provenance."""
    folder = repo / "vllm" / "forge_tuned"
    tables = sorted(folder.glob("*.json"))
    if not (folder / "__init__.py").is_file():
        return {"check": "tuned tables", "ok": False, "detail": "vllm/forge_tuned/__init__.py is missing"}
    spec = importlib.util.spec_from_file_location("submission_forge_tuned", folder / "__init__.py")
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    bad = []
    for t in tables:
        try:
            probs = loader.shipping_problems(loader.read(str(t)))
        except loader.TableError as e:
            probs = [str(e)]
        bad += [f"vllm/forge_tuned/{t.name}: {p}" for p in probs]
    return {"check": "tuned tables", "ok": not bad, "detail": "; ".join(bad) or (
        f"{len(tables)} table(s) ({', '.join(t.name for t in tables)}) valid for the loader the repository ships"
        if tables else "no per-device table: the built-in launches and routes run")}


def _onto_vendor_history(work: Path, ours: str, vendor_src: str) -> str | None:
    """With a git checkout of the vendor tree whose HEAD holds exactly the files our base commit
    holds, our commits (overlay, patches) are re-made on top of the vendor's own commit, so the
    repository is a fork of the vendor's history (what the contest's GitLab expects). Returns the new
    head, or None (a plain folder, or a checkout with local changes: our own base commit stays)."""
    src = Path(vendor_src).expanduser().resolve()
    if not (src / ".git").exists():
        return None
    # --update-shallow: the organizers' guide clones with --depth 1, and git refuses a shallow root otherwise
    fetched = tree.git(work, "fetch", "-q", "--no-tags", "--update-shallow", src, "HEAD", check=False, capture=True)
    head = tree.git(work, "rev-parse", "--verify", "-q", "FETCH_HEAD^{commit}", check=False, capture=True)
    if fetched.returncode != 0 or head.returncode != 0:
        ui.warn(f"could not fetch the vendor checkout's history from {src}; the submission starts from our base commit")
        return None
    vendor_head = head.stdout.strip()
    commits = tree.git_out(work, "rev-list", "--reverse", ours).split()
    if tree.git_out(work, "rev-parse", f"{vendor_head}^{{tree}}") != tree.git_out(work, "rev-parse", f"{commits[0]}^{{tree}}"):
        ui.warn(f"{src}: its HEAD commit holds other files than the verified copy (local changes outside the pinned "
                "files?); the submission starts from our base commit instead of the vendor's history")
        return None
    parent = vendor_head
    for c in commits[1:]:
        msg = tree.git_out(work, "log", "-1", "--format=%B", c)
        parent = tree.git(work, "commit-tree", f"{c}^{{tree}}", "-p", parent, "-m", msg, capture=True).stdout.strip()
    ui.info(f"our {len(commits) - 1} commits are on top of the vendor's own commit {vendor_head[:12]}")
    return parent


def write_submission(into: str | None = None, base: str | None = None, vendor_src: str | None = None,
                     round_name: str | None = None, tier_env: str | None = None) -> dict:
    """Write the repository and run its pre-flight. Nothing is written to the target before the
    pre-flight has run on the new repository: one that stops (a Python that cannot run setup.py, an
    interrupt) leaves the target, and build/submission-preflight.json, as they were."""
    if vendor_src and base == "standin":
        raise ForgeError(f"--vendor-src {vendor_src} goes with the vendor base; the stand-in base does not read it",
                         hint="leave out --base standin to build on that checkout, or leave out --vendor-src for "
                              "the stand-in")
    vendor_src = vendor_src or os.environ.get("VENDOR_SRC")
    base = base or ("vendor" if vendor_src else "standin")
    rnd = rounds.load_round(load_contest(), round_name or rounds.DEFAULT_ROUND)
    if tier_env and rnd.name != "final":
        raise ForgeError("--tier-env lists the final round's environment per tier; it goes with --round final",
                         hint="add --round final (make submission ROUND=final), or drop --tier-env")
    if tier_env:
        final_pick.read_tier_env(Path(tier_env))      # a wrong file is refused before anything is built
    target = target_dir(into)
    check_places(target)
    state = tree.build_tree(base=base, vendor_src=vendor_src)
    src = bases.tree_dir(base)
    basecheck.require_build_python(src)      # the pre-flight runs setup.py with this Python
    c = load_contest()
    docs = {**contest_docs.documents(c, "forge submission", forge_commit=provenance.forge_commit()["commit"],
                                     round_name=rnd.name, tier_env=Path(tier_env) if tier_env else None),
            "SUBMISSION.md": submission_md(base, state, c)}
    work = target.parent / f".{target.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    made = next((d for d in reversed([work, *work.parents]) if not d.exists()), work)   # removed on failure
    try:
        work.mkdir(parents=True)
        ui.info(f"writing the submission repository ({base} base) from {rel(src)}")
        tree.git(work, "init", "-q", "-b", "main")
        tree.git(work, "config", "core.autocrlf", "false")
        tree.git(work, "fetch", "-q", "--no-tags", src, "HEAD")
        ours = tree.git_out(work, "rev-parse", "FETCH_HEAD")
        grafted = _onto_vendor_history(work, ours, vendor_src) if base == "vendor" else None
        tree.git(work, "checkout", "-q", "-B", "main", grafted or ours)
        code = tree.git_out(work, "rev-parse", "HEAD")
        first = tree.git_out(work, "rev-parse", f"{code}~{len(state['patches']) + 1}")
        _commit_docs(work, docs, base)
        write_atomic(work / ".git" / MARKER, json.dumps({"base": base, "tree_head": state["head"],
                                                         "series_hash": provenance.series_hash(state)}) + "\n")
        ui.info(f"pre-flight on the new repository (for {target})")
        checks = preflight(work, base, code, first)
        rec = {"repository": str(target), "base": base, "code_commit": code,
               "head": tree.git_out(work, "rev-parse", "HEAD"),
               "log": tree.git_out(work, "log", "--format=%h %s").splitlines(), "preflight": checks,
               "ok": all(x["ok"] for x in checks)}
    except BaseException:
        shutil.rmtree(made, ignore_errors=True)
        raise
    PREFLIGHT.unlink(missing_ok=True)       # from here on it never describes the repository being replaced
    if target.exists():
        shutil.rmtree(target)
    os.rename(work, target)
    write_atomic(PREFLIGHT, json.dumps(rec, indent=1) + "\n")
    return rec


def cmd_submission(args) -> int:
    rec = write_submission(args.into, args.base, args.vendor_src, args.round, args.tier_env)
    print(f"submission repository: {rec['repository']} ({rec['base']} base, {len(rec['log'])} commits)")
    for line in reversed(rec["log"]):
        print(f"  {line}")
    print("pre-flight (what the platform runs, as far as this machine can):")
    for x in rec["preflight"]:
        print(f"  [{'ok' if x['ok'] else 'FAIL'}] {x['check']}: {x['detail']}")
    print(f"record: {rel(PREFLIGHT)}")
    if not rec["ok"]:
        raise ForgeError("the submission's pre-flight failed (see above)", hint="fix what failed, then rerun "
                                                                                "`make submission`")
    if rec["base"] == "standin":
        ui.warn("this is a STAND-IN submission (no VENDOR_SRC): check the flow with it, never push it")
    return 0


HELP_STAGE = "builder"        # `forge --help` lists the verb with the build stage's: a repository made from the built tree


def register(sub) -> None:
    p = sub.add_parser("submission", help="the repository a team pushes: vendor base, kernels, one commit per patch, "
                                          "the Art. 12/13 documents, and a pre-flight", description=__doc__,
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--into", help="an empty or new directory (default: dist/submission)")
    p.add_argument("--base", choices=("vendor", "standin"), default=None,
                   help="vendor when VENDOR_SRC is given, else standin (CI's stand-in: never push it)")
    p.add_argument("--vendor-src", default=None, help="the vllm_cscc checkout (default: $VENDOR_SRC); the vendor base "
                                                       "only, refused with --base standin")
    p.add_argument("--round", default=None, help="final: ENVIRONMENT.md adds the environment a team sets per tier for "
                                                 "the final (default: the preliminary)")
    p.add_argument("--tier-env", help="with --round final: the tier-environment file forge sweep --round final wrote "
                                      "(reports/final-round/tier-environment.json); default: the round's baseline "
                                      "values per tier")
    p.set_defaults(func=cmd_submission)
