"""`forge import-throughput`: the organizers' run_throughput.sh results as a run folder of ours, so
`make score`, `make compare` and `make predict` read them. Their script runs `vllm bench serve
--save-result` per tier and leaves `test/<tier>_throughput/result.json` in its testdata folder: the
same JSON our bench-all-tiers writes, copied here as reports/runs/<run-id>/<tier>.json with a
manifest saying where it came from."""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import ui
from ..errors import ForgeError
from . import contest as contest_mod
from . import runs


def find_results(folder: Path, tier: str) -> Path | None:
    for p in (folder / "test" / f"{tier}_throughput" / "result.json", folder / f"{tier}_throughput" / "result.json"):
        if p.is_file():
            return p
    return None


def import_throughput(folder: str, run_id: str | None = None, profile: str = "contest") -> Path:
    src = Path(folder).expanduser()
    contest = contest_mod.load_contest()
    found = {t: find_results(src, t) for t in contest_mod.tier_names(contest)}
    if not any(found.values()):
        raise ForgeError(f"{src}: no test/<tier>_throughput/result.json (tiers: "
                         f"{', '.join(found)})", hint="give the organizers' testdata folder after ./run_throughput.sh")
    rdir = runs.run_dir(run_id or runs.new_run_id(profile, "-organizers"))
    runs.refuse_other_profile(rdir, profile, "this import would record", hint="import into a new run (omit --run-id)")
    tiers = {}
    for t, p in found.items():
        if p is None:
            ui.warn(f"{src}: no result for tier {t}")
            continue
        res = runs.read_json(p)
        if not (isinstance(res, dict) and "output_throughput" in res and "completed" in res):
            raise ForgeError(f"{p}: not a `vllm bench serve --save-result` file", hint="rerun ./run_throughput.sh")
        shutil.copyfile(p, runs.result_path(rdir, t))
        tiers[t] = runs.tier_record("complete" if not res.get("failed") else "failed", res, None)
    runs.write_json(rdir / "manifest.json", {"profile": profile, "source": f"the organizers' run_throughput.sh ({src})",
                                            "imported": runs.now_iso(), "harness": False, "tiers": tiers})
    ui.info(f"imported {len(tiers)} tier(s) into {rdir}: `make score RUN={rdir}`")
    return rdir


def cmd_import(args) -> int:
    print(import_throughput(args.folder, args.run_id, args.profile))
    return 0


def register(sub) -> None:
    p = sub.add_parser("import-throughput", help="the organizers' run_throughput.sh results as a run folder "
                                                 "(score, compare, predict read it)", description=__doc__)
    p.add_argument("folder", help="the organizers' testdata folder (holding test/<tier>_throughput/result.json)")
    p.add_argument("--run-id", help="run folder name under reports/runs/ (default: <time>-<profile>-organizers)")
    p.add_argument("--profile", default="contest", help="the profile the server ran (default: contest)")
    p.set_defaults(func=cmd_import)
