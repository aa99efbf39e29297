"""The datasets a benchmark run sends per tier: the official tier files (DATA_DIR) or the contest's
request shape built as synthetic prompts (configs/workload.yaml); each recorded in the run's manifest,
and kept when a resume would change the one a finished tier was measured on."""

from __future__ import annotations

import os
from pathlib import Path

from .. import ui
from ..errors import ForgeError
from ..hashing import sha256_file
from . import synth
from .runs import count_lines, tier_done

# --num-prompts' bound: past any tier a round sends (the preliminary's official files, 50 in the recorded run;
# the final's 80 / 70 / 60). A billion built its list of requests after the server started, until memory ran out.
MOST_PROMPTS = 10_000
MOST_PROMPTS_WHAT = "any round sends a tier"


def check_data_dir(data_dir: str | None, tiers: list[dict]) -> dict[str, Path]:
    """DATA_DIR's official file of each tier (none without DATA_DIR): a folder holding every tier's file. A
    missing folder, a file, or a tier file missing from it is refused naming it, before anything runs."""
    if not data_dir:
        return {}
    hint = "DATA_DIR must hold the official tier files; leave it unset for synthetic data"
    folder = Path(data_dir)
    if not folder.is_dir():
        raise ForgeError(f"DATA_DIR {data_dir}: " + ("a file, not a folder" if folder.exists() else "no such folder"),
                         hint=f"give the folder holding the official tier files ({', '.join(t['file'] for t in tiers)}); "
                              "leave DATA_DIR unset for synthetic data")
    files = {}
    for t in tiers:
        files[t["name"]] = folder / t["file"]
        if not files[t["name"]].is_file():
            raise ForgeError(f"DATA_DIR {data_dir}: the tier file {t['file']} is missing", hint=hint)
    return files


def datasets(contest: dict, tiers: list[dict], data_dir: str | None, model: str | None, rdir: Path,
             num_prompts: int | None, manifest: dict, save) -> dict:
    """Each tier's dataset record (the manifest's "datasets"). A tier with a complete result keeps
    the dataset it was measured on: a resume that would change one is refused before anything is
    written. A synthetic file is built beside its place and moved there once checked, and recorded
    at once (`save()` writes the manifest), so an interrupted run keeps what it built."""
    recorded = manifest.get("datasets") or {}
    out, todo, workload = {}, [], None
    files = check_data_dir(data_dir, tiers)
    for t in tiers:                      # first what can be checked without building anything
        name = t["name"]
        prev = recorded.get(name)
        done = bool(prev) and tier_done(rdir, name)
        if data_dir:
            path = files[name]
            n = num_prompts or t["num_prompts"] or count_lines(path)
            out[name] = {"kind": "official", "path": str(path.resolve()), "num_prompts": n,
                         "sha256": sha256_file(path)}
            if done and prev.get("sha256") not in (None, out[name]["sha256"]):
                raise dataset_differs(rdir, name)
        else:
            workload = workload or synth.load_workload(contest)
            pairs = [list(x) for x in workload_pairs(workload["tiers"][name]["requests"], num_prompts or t["num_prompts"])]
            if done and prev.get("requests") != pairs:
                raise dataset_differs(rdir, name)
            todo.append((not done, name, pairs))
    for _, name, pairs in sorted(todo, key=lambda x: x[0]):   # measured tiers first: a refusal comes first
        prev = recorded.get(name)
        path = rdir / "datasets" / f"{name}.jsonl"
        sha = sha256_file(path) if path.is_file() else None
        if prev and sha and prev.get("requests") == pairs and prev.get("sha256") in (None, sha):
            out[name] = {**prev, "sha256": sha}
            continue
        if not model:
            raise ForgeError("no model directory to build the synthetic tier prompts from",
                             hint="pass --model DIR (the served model), or DATA_DIR with the tier files")
        new = path.with_name(f"{name}.new.jsonl")
        try:
            with ui.step(f"synthetic dataset {name}: {len(pairs)} requests of the contest workload (configs/workload.yaml)"):
                info = synth.build_workload_tier(Path(model), name, [tuple(x) for x in pairs], new)
            sha = sha256_file(new)
            if prev and prev.get("sha256") not in (None, sha) and tier_done(rdir, name):
                raise dataset_differs(rdir, name)
            os.replace(new, path)
        finally:
            for p in (new, new.with_suffix(".tmp")):
                p.unlink(missing_ok=True)
        out[name] = {"kind": "synthetic", "shape": "contest workload (configs/workload.yaml)",
                     "path": str(path), "num_prompts": len(pairs), "requests": pairs,
                     "input_lens": info["input_lens"], "prompt_tokens": info["prompt_tokens"],
                     "chat_template": info["chat_template"], "tokenizer": str(model), "sha256": sha}
        manifest["datasets"] = {**recorded, **out}
        save()
    return {**recorded, **{t["name"]: out[t["name"]] for t in tiers}}


def workload_pairs(pairs: list, n: int | None) -> list:
    """n of the workload's (input_len, output_len) pairs (synth.stratified); more than it holds (a
    round whose tier sends more requests than the recorded run had: the final's 80 / 70 / 60) repeats
    them in order, each repeat a prompt of its own."""
    if n is None or n <= len(pairs):
        return synth.stratified(pairs, n)
    return [pairs[i % len(pairs)] for i in range(n)]


def dataset_differs(rdir: Path, name: str) -> ForgeError:
    return ForgeError(f"tier {name}: the dataset differs from the one run {rdir.name} was measured on",
                      hint="resume with the same DATA_DIR, --num-prompts and --model, or start a new run (omit --run-id)")
