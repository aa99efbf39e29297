"""The two documents a submission carries, written from the repository's own records (the report
stage's, see report.py):

  ENVIRONMENT.md  (rules Art. 12) every environment variable our changes read: the value the
                  submission runs with (the default in code: the platform sets none), what it does,
                  why; and the organizers' start script it is served with
  OPTIMIZATION.md (rules Art. 13) the methods (each patch's review record), each optimization's
                  measured contribution from the recorded runs under reports/e2e/
                  (configs/optimizations.yaml), and a summary table
"""

from __future__ import annotations

import json
import re
import shlex
import tarfile
from pathlib import Path

from .. import config, paths
from ..errors import ForgeError
from . import contest as contest_mod
from .report import _cell, _header

# variables our code reads that are not ours (so not in the series' vllm/envs.py additions)
KNOWN_OTHER = {"TRITON_INTERPRET": "Triton's interpreter switch: our kernels check it to run their CPU "
                                   "test path; unset on the platform (the compiled path runs)."}
_READ = re.compile(r"""os\.(?:getenv|environ\.get)\(\s*["']([A-Z][A-Z0-9_]+)["']|os\.environ\[\s*["']([A-Z][A-Z0-9_]+)""")


def _envs_added(patch_text: str) -> str:
    """The lines a patch adds to vllm/envs.py, without their '+'."""
    out, on = [], False
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            on = line.endswith(" b/vllm/envs.py")
        elif on and line.startswith("+") and not line.startswith("+++"):
            out.append(line[1:])
    return "\n".join(out)


def series_env_vars(patches_dir: Path = paths.PATCHES) -> list[dict]:
    """[{name, default, doc, patch}] for each variable the series adds to vLLM's envs.py, in series order:
    its default is the string vLLM reads when it is unset; doc is the comment above its entry."""
    from ..builder.patchfile import parse, read_series
    found: dict[str, dict] = {}
    for name in read_series(patches_dir):
        added = _envs_added((patches_dir / name).read_text(errors="replace"))
        lines = added.splitlines()
        for i, line in enumerate(lines):
            m = re.match(r'\s*"([A-Z][A-Z0-9_]+)":', line)
            if not m or m.group(1) in found:
                continue
            var = m.group(1)
            d = re.search(r'(?:os\.getenv|env_with_choices)\(\s*"' + var + r'",\s*"([^"]*)"', added)
            doc, j = [], i - 1
            while j >= 0 and lines[j].strip().startswith("#"):
                doc.insert(0, lines[j].strip().lstrip("#").strip())
                j -= 1
            found[var] = {"name": var, "default": d.group(1) if d else None, "doc": " ".join(doc),
                          "patch": name, "subject": parse(patches_dir / name).subject}
    return list(found.values())


def other_env_reads(entries: list[dict], ours: set[str]) -> dict[str, list[str]]:
    """{variable: [overlay destinations]} our kernel files read that the series does not define."""
    out: dict[str, list[str]] = {}
    for e in entries:
        text = (paths.ROOT / e["src"]).read_text(errors="replace")
        for m in _READ.finditer(text):
            var = m.group(1) or m.group(2)
            if var not in ours:
                out.setdefault(var, []).append(e["dst"])
    return {k: sorted(set(v)) for k, v in sorted(out.items())}


def _why(patch_path: Path) -> str:
    from ..builder.patchfile import parse
    text = " ".join(parse(patch_path).sections().get("Why", "").split())
    sentences = re.split(r"(?<=[.;])\s+", text)
    short = ""
    for s in sentences:
        if len(short) + len(s) > 420 and short:
            break
        short = f"{short} {s}".strip()
    return short


def defaults_problems(profile: dict, env_vars: list[dict]) -> list[str]:
    """Variables the profile sets to something other than the default in code: the platform sets no
    variable, so the submission must be what the profile measures with none set."""
    defaults = {v["name"]: v["default"] for v in env_vars}
    out = []
    for k, e in profile["env"].items():
        if k in defaults and str(e["value"]) != defaults[k] and \
                not (defaults[k] in ("1", "true") and str(e["value"]).lower() in ("1", "true")):
            out.append(f"{k}: profile {profile['name']} sets {e['value']!r}, the default in code is {defaults[k]!r} "
                       f"({e['source']})")
    return out


def environment_md(contest: dict, profile: dict, env_vars: list[dict], other: dict[str, list[str]],
                   verb: str = "forge submission") -> str:
    argv = contest_mod.organizers_argv(contest, contest["server"]["start_script"]["model_placeholder"])
    L = [_header(verb), "", "# Environment variables (rules Art. 12)", "",
         "The scored server is the organizers' start script, run as it is (source: "
         f"{contest['server']['start_script']['source']}):", "", "```", shlex.join(argv).replace("'$MODEL_DIR'", "$MODEL_DIR"), "```", "",
         "**No environment variable needs to be set.** Every speed-up of this submission is on by default in "
         "code; each variable below exists so a run can turn one change off (its other value restores vLLM "
         "0.18.1's own path) for A/B measurements and accuracy checks.", "",
         "## Variables our changes read", "",
         "| variable | value in this submission (default) | what it does | why | added by |", "|---|---|---|---|---|"]
    for v in env_vars:
        shown = f"`{_cell(v['default'])}`" if v["default"] else "empty"
        L.append(f"| `{v['name']}` | {shown} (unset) | {_cell(v['doc'])} | "
                 f"{_cell(_why(paths.PATCHES / v['patch']))} | {_cell(v['subject'])} |")
    if other:
        L += ["", "## Other variables our code reads", "", "| variable | read by | what it does |", "|---|---|---|"]
        for var, where in other.items():
            L.append(f"| `{var}` | {', '.join(f'`{w}`' for w in where)} | "
                     f"{_cell(KNOWN_OTHER.get(var, 'not set by this submission'))} |")
    L += ["", f"## The profile measured as this submission: `{profile['name']}`", "",
          f"{profile['description']} Its variables equal the defaults above, so what was measured with it is what "
          "runs with none set:", "", "| variable | value |", "|---|---|"]
    L += [f"| `{k}` | `{_cell(e['value'])}` |" for k, e in profile["env"].items()] or ["| (none) | |"]
    return "\n".join(L) + "\n"


# --- OPTIMIZATION.md --------------------------------------------------------------------------

OPT_SCHEMA = {"optimizations": config.Field(list, item={
    "name": config.Field(str), "patches": config.Field(list, item=str), "switch": config.Field(str),
    "evidence": config.Field(list, item={"run": config.Field(str), "with": config.Field(str),
                                         "without": config.Field(str),
                                         "note": config.Field(str, required=False, default=None)})})}


def load_optimizations(path: Path | str = "optimizations.yaml") -> list[dict]:
    from ..builder.patchfile import read_series
    data = config.load(path, OPT_SCHEMA)["optimizations"]
    series = set(read_series(paths.PATCHES))
    for i, o in enumerate(data):
        for p in o["patches"]:
            if p not in series:
                raise ForgeError(f"configs/optimizations.yaml: key 'optimizations[{i}].patches': {p} is not in "
                                 "patches/series", hint="fix the name, or drop the patch from the entry")
        for j, e in enumerate(o["evidence"]):
            if not (paths.ROOT / e["run"] / "raw.tgz").is_file():
                raise ForgeError(f"configs/optimizations.yaml: key 'optimizations[{i}].evidence[{j}].run': "
                                 f"{e['run']}/raw.tgz does not exist")
    return data


def run_evidence(run: str, with_: str, without: str, tiers: list[str]) -> dict:
    """Per tier: both profiles' output tok/s, mean TTFT and TPOT from a recorded run's archive, and
    what its servers ran with (device, versions, the command and environment of each)."""
    members: dict[str, dict] = {}
    with tarfile.open(paths.ROOT / run / "raw.tgz") as tf:
        for m in tf.getmembers():
            if m.isfile() and m.name.endswith((".json",)) and ("/runs/" in f"/{m.name}" or m.name.endswith("summary.json")):
                f = tf.extractfile(m)
                if f is not None:
                    members[m.name] = json.loads(f.read())

    def find(suffix: str) -> dict:
        hit = [v for k, v in members.items() if k == suffix or k.endswith("/" + suffix)]
        if not hit:
            raise ForgeError(f"{run}/raw.tgz: no {suffix}", hint="check configs/optimizations.yaml (profile names)")
        return hit[0]
    summary = find("summary.json")
    out = {"run": run, "device": summary.get("versions", {}).get("device"), "versions": summary.get("versions", {}),
           "tiers": {}}
    for t in tiers:
        a, b = find(f"runs/{with_}/{t}.json"), find(f"runs/{without}/{t}.json")
        out["tiers"][t] = {"with_tok_s": a["output_throughput"], "without_tok_s": b["output_throughput"],
                           "gain": a["output_throughput"] / b["output_throughput"] - 1,
                           "ttft_ratio": a["mean_ttft_ms"] / b["mean_ttft_ms"],
                           "tpot_ratio": a["mean_tpot_ms"] / b["mean_tpot_ms"], "requests": a.get("completed")}
    sa, sb = find(f"runs/{with_}/serve.json"), find(f"runs/{without}/serve.json")
    out["env_diff"] = {k: (sa["env"].get(k), sb["env"].get(k)) for k in sorted(set(sa["env"]) | set(sb["env"]))
                       if sa["env"].get(k) != sb["env"].get(k)}
    launch = sa.get("launch") or []
    out["server_options"] = launch[launch.index("serve") + 2:] if "serve" in launch else sa.get("command", [])[3:]
    return out


def _pct(x: float) -> str:
    return f"{x * 100:+.1f} %"


def optimization_md(contest: dict, optimizations: list[dict], verb: str = "forge submission",
                    forge_commit: str | None = None) -> str:
    from ..builder.patchfile import REVIEW_SECTIONS, parse, read_series
    tiers = contest_mod.tier_names(contest)
    where = f"dcu-forge{f' commit `{forge_commit[:12]}`' if forge_commit else ''}"
    L = [_header(verb), "", "# Optimizations (rules Art. 13)", "",
         "This repository is the vendor's vLLM 0.18.1 tree with one commit for our kernel files and one commit per "
         "change; each change's commit message is its review record (why, what, risk, evidence, rule check), "
         f"reproduced under Methods. The figures come from runs recorded in {where} under `reports/e2e/` (each "
         "run's archive holds its servers' commands and every request's result). They were measured on a GPU "
         "machine with the project's harness: random weights, the options listed per run (not the organizers' "
         "start script) and the run's own device; read them as each change's relative effect against the same "
         "run's reference, not as scores on the DCU.", "", "## Summary", "",
         "| optimization | switch (on by default) | measured: output tok/s per tier (" + " / ".join(tiers) + ") | "
         "TTFT ratio | TPOT ratio | run |", "|---|---|---|---|---|---|"]
    detail = []
    for o in optimizations:
        for e in o["evidence"]:
            ev = run_evidence(e["run"], e["with"], e["without"], tiers)
            t = ev["tiers"]
            L.append(f"| {_cell(o['name'])} | `{_cell(o['switch'])}` | " + " / ".join(_pct(t[x]["gain"]) for x in tiers)
                     + " | " + " / ".join(f"{t[x]['ttft_ratio']:.3f}" for x in tiers) + " | "
                     + " / ".join(f"{t[x]['tpot_ratio']:.3f}" for x in tiers) + f" | `{Path(e['run']).name}` |")
            detail += [f"### {o['name']}: `{e['with']}` against `{e['without']}`", "",
                       f"Run `{e['run']}` on {ev['device'] or 'an unnamed device'} ("
                       + ", ".join(f"{k} {v}" for k, v in ev["versions"].items() if k != "device") + ")."
                       + (f" {e['note']}." if e.get("note") else ""), "",
                       "What differs between the two servers: " + ("; ".join(
                           f"`{k}` {a!r} against {b!r}" for k, (a, b) in ev["env_diff"].items()) or "nothing in "
                           "their environment (their options differ)") + ".", "",
                       f"Server options of that run (after the model): `{_cell(shlex.join(ev['server_options']))}`.", "",
                       "| tier | with: tok/s | without: tok/s | tok/s | TTFT ratio | TPOT ratio | requests |",
                       "|---|---:|---:|---:|---:|---:|---:|"]
            detail += [f"| {x} | {t[x]['with_tok_s']:.2f} | {t[x]['without_tok_s']:.2f} | {_pct(t[x]['gain'])} | "
                       f"{t[x]['ttft_ratio']:.3f} | {t[x]['tpot_ratio']:.3f} | {t[x]['requests']} |" for x in tiers]
            detail.append("")
    L += ["", "## Measured contribution of each optimization", "", *detail, "## Methods", ""]
    for i, name in enumerate(read_series(paths.PATCHES), 1):
        patch = parse(paths.PATCHES / name)
        sec = patch.sections()
        L += [f"### {i}. {patch.subject}", "", "Touches: " + ", ".join(f"`{t}`" for t in patch.touched()), ""]
        for s in REVIEW_SECTIONS:
            L += [f"**{s}.**", "", sec.get(s) or "_missing_", ""]
    return "\n".join(L).rstrip() + "\n"
