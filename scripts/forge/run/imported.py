"""`forge import-throughput`: the organizers' run_throughput.sh results as a run folder of ours, so
`make score`, `make compare` and `make predict` read them. Their script runs `vllm bench serve
--save-result` per tier and leaves `test/<tier>_throughput/result.json` in its testdata folder: the
same JSON our bench-all-tiers writes, copied here as reports/runs/<run-id>/<tier>.json with a
manifest saying where it came from.

Every result is read and checked as `score` reads it before anything is written, and the run folder
appears whole or not at all. A result measured by another client than the preliminary's (its
`max_concurrency` and `request_rate`: their script sends one request at a time at rate 1, configs/contest.yaml
client) is refused: the run would be scored against the preliminary's baselines. A run id whose folder already holds a run (results, a score, files git
tracks) is refused unless --force (FORCE=1), which replaces that folder whole."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import options, paths, records, ui
from ..contest import profiles, rounds
from ..contest import rules as contest_mod
from ..errors import ForgeError
from . import results, runs


def find_results(folder: Path, tier: str) -> Path | None:
    for p in (folder / "test" / f"{tier}_throughput" / "result.json", folder / f"{tier}_throughput" / "result.json"):
        if p.is_file():
            return p
    return None


def check_profile(profile: str) -> str:
    """The profile the organizers' server ran: a profile of configs/serve/ (it labels the run)."""
    paths.plain_name(profile, "--profile")
    known = profiles.profile_names()
    if profile not in known:
        raise ForgeError(f"--profile {profile!r}: no such profile (configs/serve/{profile}.yaml)",
                         hint=f"give the profile the server ran: {', '.join(known)} (the organizers' start script "
                              "is `contest`, the default)")
    return profile


def check_client(res: dict, path: Path, contest: dict, tier: str) -> None:
    """A result measured by the preliminary's client (configs/contest.yaml client: the organizers'
    run_throughput.sh, one request at a time at rate 1), as the result records it (`max_concurrency`,
    `request_rate`; a key not there is not checked): the run folder is of the preliminary, so one measured at
    another concurrency or rate (the finals' client: 10 at once, rate inf) would be scored against the
    preliminary's baselines without a word."""
    tc = rounds.load_round(contest, rounds.DEFAULT_ROUND).client(tier)
    want = {"max_concurrency": tc.concurrency, "request_rate": tc.request_rate}
    bad = [f"key '{k}' is {json.dumps(res[k])[:30]}" for k, w in want.items() if k in res
           and (isinstance(res[k], bool) or not isinstance(res[k], (int, float)) or res[k] != w)]
    if bad:
        raise ForgeError(f"{paths.rel(path)}: {', '.join(bad)}: not measured by the preliminary's client "
                         f"(--max-concurrency {tc.concurrency} --request-rate {tc.request_rate:g}, configs/contest.yaml "
                         "client: the organizers' run_throughput.sh), so not comparable to its baselines",
                         hint="import the results of the organizers' run_throughput.sh as it runs (one request at a "
                              "time); a final-round run is measured with forge bench-all-tiers --round final, which "
                              "records its round")


def holds_a_run(rdir: Path) -> str | None:
    """What run folder `rdir` already holds (None: nothing, or no folder)."""
    if not rdir.is_dir():
        return "a file" if rdir.exists() or rdir.is_symlink() else None
    files = [p for p in rdir.rglob("*") if p.is_file()]
    if not files:
        return None
    what = []
    if (rdir / "score.json").is_file():
        what.append("a score")
    tiers = [p.stem for p in rdir.glob("*.json") if p.name not in ("manifest.json", "score.json", "serve.json")]
    if tiers:
        what.append(f"results of {', '.join(sorted(tiers))}")
    if paths.tracked_files(rdir):
        what.append("files tracked by git")
    return ", ".join(what) or f"{len(files)} file(s)"


def import_throughput(folder: str, run_id: str | None = None, profile: str = "contest", force: bool = False) -> Path:
    check_profile(profile)
    if run_id is not None:
        runs.check_run_id(run_id)
    src = Path(folder).expanduser()
    if not src.is_dir():
        raise ForgeError(f"{folder}: not a folder", hint="give the organizers' testdata folder after ./run_throughput.sh")
    contest = contest_mod.load_contest()
    found = {t: find_results(src, t) for t in contest_mod.tier_names(contest)}
    if not any(found.values()):
        raise ForgeError(f"{src}: no test/<tier>_throughput/result.json (tiers: "
                         f"{', '.join(found)})", hint="give the organizers' testdata folder after ./run_throughput.sh")
    # every result read and checked as score reads it, before anything is written
    read = {}
    for t, p in found.items():
        if p is None:
            ui.warn(f"{src}: no result for tier {t}")
            continue
        try:
            read[t] = results.read_result(p)
        except ForgeError as e:
            raise ForgeError(e.message, hint="the organizers' result file is damaged or not theirs; rerun "
                                             "./run_throughput.sh for that tier") from None
        check_client(read[t], p, contest, t)
    rdir = runs.run_dir(run_id or runs.new_run_id(profile, "-organizers"), create=False)
    held = holds_a_run(rdir)
    records.guard_recorded(f"run {rdir.name} ({paths.rel(rdir)})", held, doing="importing", force=force,
                           hint="import into a new run (omit --run-id, or give a new one); --force replaces the run "
                                "folder whole")
    tiers = {}
    with paths.staged_result(rdir, replace=force) as tmp:
        for t, res in read.items():
            shutil.copyfile(found[t], runs.result_path(tmp, t))
            tiers[t] = runs.tier_record("complete" if not res.get("failed") else "failed", res, None)
        runs.write_json(tmp / "manifest.json", {"profile": profile, "source": f"the organizers' run_throughput.sh "
                                                                               f"({src})",
                                                "imported": runs.now_iso(), "harness": False, "tiers": tiers})
    ui.info(f"imported {len(tiers)} tier(s) into {rdir}" + (f" (replacing what it held: {held})" if held else "")
            + f": `make score RUN={rdir}`")
    return rdir


def cmd_import(args) -> int:
    print(import_throughput(args.folder, args.run_id, args.profile, options.forced(args.force)))
    return 0


def register(sub) -> None:
    p = sub.add_parser("import-throughput", help="the organizers' run_throughput.sh results as a run folder "
                                                 "(score, compare, predict read it)", description=__doc__)
    p.add_argument("folder", help="the organizers' testdata folder (holding test/<tier>_throughput/result.json)")
    p.add_argument("--run-id", help="run folder name under reports/runs/ (default: <time>-<profile>-organizers)")
    p.add_argument("--profile", default="contest", help="the profile the server ran (default: contest)")
    p.add_argument("--force", action="store_true",
                   help="replace the run folder of --run-id whole when it already holds a run (also FORCE=1)")
    p.set_defaults(func=cmd_import)
