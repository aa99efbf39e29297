"""`make rehearsal`: the whole build, proven on any Linux box without a DCU.

fetch → tree → patches-check → wheel (pure Python) → fresh venv with CPU torch → install the wheel
→ import vllm + its provenance → `vllm serve --help` shows the patched options → our kernels'
self-test under Triton's interpreter → ahead-of-time compile of our Triton kernels for the
stand-in AMD targets with the LDS (≤ 64 KiB) and register-spill check → reports/rehearsal.{md,json}.

Finished stages are not redone on a rerun (the tree, wheel and venv are reused when their inputs
are unchanged); the checks always run.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sys
import time
from pathlib import Path

from .. import config, proc, records, ui
from ..errors import ForgeError
from ..hashing import sha256_file
from ..paths import BUILD, KERNELS, REPORTS, TREE, rel, write_atomic
from ..recipe import provenance
from . import fetch, patches, tree, wheel

VENV = BUILD / "rehearsal" / "venv"


def ensure_venv(whl: Path, torch_spec: str, venv: Path = VENV, extra: list[str] = ()) -> Path:
    """A venv holding CPU torch and the wheel (with its dependencies); rebuilt when either changes."""
    py = venv / "bin" / "python"
    marker = venv / ".forge-installed"
    want = f"{torch_spec}\n{whl.name}\n{sha256_file(whl)}\n{' '.join(extra)}\n"
    if py.exists() and marker.is_file() and marker.read_text() == want:
        ui.info(f"{rel(venv)} already has {whl.name}")
        return py
    log = BUILD / "rehearsal" / "venv.log"
    log.unlink(missing_ok=True)
    if not (py.exists() and marker.is_file() and marker.read_text().split("\n")[0] == torch_spec):
        shutil.rmtree(venv, ignore_errors=True)
        ui.info(f"creating {rel(venv)}; installing {torch_spec} (log: {rel(log)})")
        proc.run([sys.executable, "-m", "venv", venv], what="venv creation")
        proc.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], log=log, what="pip upgrade")
        proc.run([py, "-m", "pip", "install", *torch_spec.split()], log=log, what=f"pip install {torch_spec}",
                 hint=f"see {rel(log)}; the torch pin is configs/build.yaml rehearsal.torch")
        write_atomic(marker, f"{torch_spec}\n")
    ui.info(f"installing {whl.name} with its dependencies (log: {rel(log)})")
    proc.run([py, "-m", "pip", "install", "--force-reinstall", "--no-deps", whl], log=log, what="pip install wheel")
    proc.run([py, "-m", "pip", "install", whl, *extra], log=log, what="pip install wheel dependencies",
             hint=f"see {rel(log)}")
    write_atomic(marker, want)
    return py


_IMPORT_CHECK = r"""
import json, vllm, vllm._forge_provenance as p
print(json.dumps({"version": vllm.__version__, "series_hash": p.PROVENANCE["series_hash"],
                  "file": vllm.__file__}))
"""


def check_import(py: Path, whl_version: str, series_hash: str) -> dict:
    out = proc.output([py, "-c", _IMPORT_CHECK], what="import vllm", env={"PYTHONPATH": ""}).splitlines()[-1]
    info = json.loads(out)
    if info["version"] != whl_version or info["series_hash"] != series_hash:
        raise ForgeError(f"installed vllm is {info['version']} (series {info['series_hash'][:10]}), "
                         f"expected {whl_version} (series {series_hash[:10]})",
                         hint=f"remove {rel(VENV)} and rerun")
    return info


def check_serve_help(py: Path, must: list[str]) -> list[str]:
    vllm_bin = py.parent / "vllm"
    res = proc.run([vllm_bin, "serve", "--help=all"], capture=True, what="vllm serve --help",
                   env={"PYTHONPATH": ""}, timeout=600)
    text = res.stdout + res.stderr
    missing = [m for m in must if m not in text]
    if missing:
        raise ForgeError(f"`vllm serve --help=all` of the patched build lacks: {', '.join(missing)}",
                         hint="a patch that adds these options did not apply or did not ship "
                              "(configs/build.yaml rehearsal.serve_help_must_contain)")
    return must


def run_json_tool(argv: list[str], json_out: Path, what: str, env: dict | None = None) -> dict:
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.unlink(missing_ok=True)
    log = json_out.with_suffix(".log")
    log.unlink(missing_ok=True)
    proc.run([*argv, "--json", json_out], log=log, what=what, env=env, hint=f"see {rel(log)}")
    return records.read_json(json_out)


def rehearse(report_dir: Path = REPORTS) -> dict:
    b = config.build()
    t_start = time.monotonic()
    stages: list[dict] = []
    result = {"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "make rehearsal", "stages": stages}

    def stage(name, fn):
        t0 = time.monotonic()
        with ui.step(f"rehearsal: {name}"):
            try:
                detail = fn()
            except ForgeError as e:
                stages.append({"stage": name, "ok": False, "seconds": round(time.monotonic() - t0, 1),
                               "error": e.message})
                result["ok"] = False
                write_report(result, report_dir)
                raise
        stages.append({"stage": name, "ok": True, "seconds": round(time.monotonic() - t0, 1), "detail": detail})
        return detail

    src = stage("fetch + verify source", lambda: str(fetch.ensure_source()))
    stage("tree", lambda: {"head": tree.build_tree()["head"]})
    stage("patches-check", lambda: {"trees": patches.check()})
    whl = Path(stage("wheel (pure Python)", lambda: str(wheel.build_wheel("empty"))))
    state = tree.read_state(TREE)
    version = wheel.wheel_version(state, "empty")
    sh = provenance.series_hash(state)
    py = Path(stage("venv + install", lambda: str(ensure_venv(whl, b["rehearsal"]["torch"], extra=b["rehearsal"]["extra_packages"]))))
    stage("import vllm", lambda: check_import(py, version, sh))
    stage("vllm serve --help", lambda: {"found": check_serve_help(py, b["rehearsal"]["serve_help_must_contain"])})
    work = BUILD / "rehearsal"
    stage("kernel self-test (Triton interpreter)",
          lambda: run_json_tool([sys.executable, KERNELS / "selftest.py"], work / "selftest.json",
                                "kernel self-test", env={"TRITON_INTERPRET": "1"}))
    targets = []
    for t in b["aot_targets"]:
        targets += ["--target", t]
    stage("AOT compile + LDS/spill check (" + ", ".join(b["aot_targets"]) + ")",
          lambda: run_json_tool([sys.executable, KERNELS / "aot.py", *targets], work / "aot.json",
                                "ahead-of-time compile"))
    result.update(ok=True, seconds=round(time.monotonic() - t_start, 1), wheel=whl.name, version=version,
                  series_hash=sh, source=src, upstream=config.upstream()["sdist"]["sha256"],
                  patches=[n for n, _, _ in state["patches"]], toolchain=provenance.toolchain(),
                  forge=provenance.forge_commit())
    write_report(result, report_dir)
    return result


def write_report(result: dict, report_dir: Path) -> None:
    report_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(report_dir / "rehearsal.json", json.dumps(result, indent=1, default=str) + "\n")
    ok = result.get("ok")
    lines = ["<!-- generated by `make rehearsal` (scripts/forge/builder/rehearsal.py); do not edit -->",
             "# Rehearsal report", "",
             f"Result: **{'PASS' if ok else 'FAIL'}** — started {result['started']}"
             + (f", {result['seconds']} s in all" if "seconds" in result else ""), ""]
    if ok:
        tc = result["toolchain"]
        lines += [f"- wheel: `{result['wheel']}` (series {result['series_hash'][:10]})",
                  f"- upstream sdist sha256: `{result['upstream']}`",
                  f"- patches: {', '.join(result['patches']) or '(none)'}",
                  f"- forge commit: `{result['forge'].get('commit')}`" + (" (dirty)" if result['forge'].get('dirty') else ""),
                  f"- toolchain: Python {tc['python']}, torch {tc['torch']}, triton {tc['triton']}", ""]
    lines += ["| stage | result | seconds |", "|---|---|---|"]
    for s in result["stages"]:
        lines.append(f"| {s['stage']} | {'ok' if s['ok'] else 'FAILED: ' + s['error'].splitlines()[0]} | {s['seconds']} |")
    aot = next((s for s in result["stages"] if s["stage"].startswith("AOT") and s["ok"]), None)
    if aot and isinstance(aot.get("detail"), (list, dict)):
        rows = aot["detail"] if isinstance(aot["detail"], list) else aot["detail"].get("results", [])
        if rows:
            lines += ["", "## Ahead-of-time compile", "", "| kernel | target | LDS bytes | registers | spills |",
                      "|---|---|---|---|---|"]
            for r in rows:
                lines.append(f"| {r.get('kernel')} {r.get('variant', '')} | {r.get('target')} | {r.get('shared')} | "
                             f"{r.get('registers', r.get('vgprs', ''))} | {r.get('spills', '')} |")
    write_atomic(report_dir / "rehearsal.md", "\n".join(lines) + "\n")


def cmd_rehearsal(args) -> int:
    r = rehearse()
    print(f"rehearsal: PASS in {r['seconds']} s; report: reports/rehearsal.md")
    return 0


def register(sub) -> None:
    p = sub.add_parser("rehearsal", help="full-compile rehearsal on any Linux box: fetch, tree, wheel, install, self-tests, AOT",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.set_defaults(func=cmd_rehearsal)
