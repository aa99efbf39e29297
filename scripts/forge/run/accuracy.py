"""`forge accuracy`: the contest's accuracy sets against the running server. With the official
data (DATA_DIR containing run_accuracy.sh) the official script runs and its output is recorded;
otherwise LongBench-format jsonl files are evaluated here (F1 for QA, ROUGE-L for summaries, list
matching for retrieval/aggregation). `--baseline` turns a result into the contest's accuracy factor."""

from __future__ import annotations

import json
import os
import re
import string
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from .. import options, paths, proc, records, ui
from ..contest import rules as contest_mod
from ..contest.profiles import loopback_env
from ..errors import ForgeError
from ..hashing import sha256_file
from . import runs, score, serve, server_record

# --- metrics (LongBench's definitions) -----------------------------------------------------------

def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def qa_f1(prediction: str, truth: str) -> float:
    p, t = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = Counter(p) & Counter(t)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(t)
    return 2 * precision * recall / (precision + recall)


_ROUGE = None


def rouge_l(prediction: str, truth: str) -> float:
    global _ROUGE
    if _ROUGE is None:
        try:
            from rouge_score import rouge_scorer  # optional (the contest extra): the ROUGE-L metric only
        except ImportError:
            raise ForgeError("ROUGE-L needs the rouge-score package, which is not installed",
                             hint="pip install rouge-score (listed in requirements/dev.txt)")
        _ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return _ROUGE.score(truth, prediction)["rougeL"].fmeasure


def list_items(answer) -> list[str]:
    if isinstance(answer, list):
        items = [str(x) for x in answer]
    else:
        items = re.split(r"[,\n;]", str(answer))
    return [x.strip() for x in items if x.strip()]


def list_match(prediction: str, truth) -> float:
    """Share of the expected items that appear in the prediction (case-insensitive)."""
    items = list_items(truth)
    if not items:
        return 0.0
    pred = prediction.lower()
    return sum(1 for x in items if x.lower() in pred) / len(items)


def record_score(metric: str, prediction: str, answers) -> float:
    if metric == "list_match":
        # one answer list per record; LongBench stores it as `answers`
        truth = answers if answers and not isinstance(answers[0], list) else answers[0]
        return list_match(prediction, truth)
    fn = qa_f1 if metric == "qa_f1" else rouge_l
    return max((fn(prediction, str(a)) for a in answers), default=0.0)


# --- evaluation against the server -------------------------------------------------------------------

RESULT = "accuracy.json"                      # what `forge score` reads: complete results only
PROGRESS = "accuracy.progress.jsonl"          # our evaluator's per-record scores while it runs
FAILED = "accuracy.failed.json"               # a failed official run's record, for diagnosis


def read_jsonl(path: Path) -> list[dict]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ForgeError(f"{path}:{i}: not valid JSON ({e})")
    return out


def build_prompt(task: dict, rec: dict, where: str) -> str:
    if "prompt" in rec:
        return rec["prompt"]
    try:
        return task["template"].format(context=rec.get("context", ""), input=rec.get("input", ""))
    except (KeyError, IndexError) as e:
        raise ForgeError(f"{where}: the task template needs field {e}")


def chat(url: str, model: str, prompt: str, max_tokens: int, timeout: float = 900) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "temperature": 0, "max_tokens": max_tokens, "stream": False}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as r:
            data = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ForgeError(f"{url}: HTTP {e.code}: {e.read()[:300]!r}")
    except (urllib.error.URLError, OSError) as e:
        raise ForgeError(f"{url}: the server did not answer ({e})", hint="start it: forge serve")
    return data["choices"][0]["message"]["content"] or ""


def eval_settings(contest: dict, data_dir: Path, model: str, limit: int | None) -> tuple[dict, dict]:
    """The tasks found in data_dir, and everything a record's score depends on besides the server:
    saved scores are reused only under equal settings."""
    tasks = contest["accuracy"]["tasks"]
    found = {n: t for n, t in tasks.items() if (data_dir / t["file"]).is_file()}
    if not found:
        raise ForgeError(f"{data_dir}: none of the accuracy files is here",
                         hint="expected: " + ", ".join(t["file"] for t in tasks.values()))
    settings = {"model": model, "limit": limit, "tasks": {
        n: {"file": t["file"], "sha256": sha256_file(data_dir / t["file"]), "metric": t["metric"],
            "max_tokens": t["max_tokens"], "template": t.get("template")} for n, t in found.items()}}
    return found, settings


def saved_progress(path: Path, settings: dict) -> dict | None:
    """Per-task scores saved in `path` under the same settings, else None. A line cut short by an
    interruption (and anything after it) is dropped from the file."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    try:
        head = json.loads(lines[0])
    except ValueError:
        return None
    if not isinstance(head, dict) or head.get("settings") != settings:
        return None
    saved = {n: [] for n in settings["tasks"]}
    good = len(lines[0]) + 1
    for line in lines[1:]:
        try:
            r = json.loads(line)
            name, i, v = r["task"], r["i"], float(r["score"])
        except (ValueError, TypeError, KeyError):
            break
        if name not in saved or i != len(saved[name]):
            break
        saved[name].append(v)
        good += len(line) + 1
    if good < len(data):
        os.truncate(path, good)
    return saved


def evaluate(contest: dict, data_dir: Path, url: str, model: str, limit: int | None,
             rdir: Path, force: bool = False) -> dict:
    """Our evaluator. Each record's score is appended to rdir/accuracy.progress.jsonl as soon as it
    is known; a rerun with the same settings continues after the last saved record."""
    found, settings = eval_settings(contest, data_dir, model, limit)
    prog = rdir / PROGRESS
    saved = saved_progress(prog, settings) if prog.is_file() else None
    if prog.is_file() and saved is None:
        if not force:
            raise ForgeError(f"{paths.rel(prog)}: run {rdir.name} holds an unfinished evaluation with other "
                             "data or settings (--data files, --limit, the model, the tasks in "
                             "configs/contest.yaml); its scores are not mixed with this one",
                             hint="rerun with the same settings to resume it, pass --force to discard it and "
                                  "start over, or use another --run-id")
        ui.warn(f"{paths.rel(prog)}: discarding an unfinished evaluation with other settings (--force)")
    rdir.mkdir(parents=True, exist_ok=True)
    if saved is None:
        saved = {n: [] for n in found}
        head = {"settings": settings, "data": str(data_dir), "started": runs.now_iso()}
        paths.write_atomic(prog, json.dumps(head) + "\n")
    elif sum(map(len, saved.values())):
        ui.info(f"resuming: {sum(map(len, saved.values()))} records already evaluated in {paths.rel(prog)}")
    scores = {}
    with open(prog, "a") as out:
        try:
            for name, t in found.items():
                path = data_dir / t["file"]
                recs = read_jsonl(path)[: limit or None]
                vals = saved[name]
                t0 = time.monotonic()
                for i in range(len(vals), len(recs)):
                    rec = recs[i]
                    pred = chat(url, model, build_prompt(t, rec, f"{path}:{i + 1}"), t["max_tokens"])
                    answers = rec.get("answers", rec.get("answer", []))
                    if isinstance(answers, str):
                        answers = [answers]
                    v = record_score(t["metric"], pred, answers)
                    out.write(json.dumps({"task": name, "i": i, "score": v}) + "\n")
                    out.flush()
                    vals.append(v)
                    if (i + 1) % 10 == 0 or i + 1 == len(recs):
                        ui.info(f"accuracy {name}: {i + 1}/{len(recs)} ({time.monotonic() - t0:.0f}s)")
                scores[name] = 100.0 * sum(vals) / len(vals) if vals else 0.0
        except BaseException:
            ui.info(f"{sum(map(len, saved.values()))} evaluated records are saved in {paths.rel(prog)}; "
                    f"rerun with --run-id {rdir.name} and the same settings to resume")
            raise
    return {"scores": scores, "per_request": saved}


def parse_official(text: str, tasks: list[str]) -> dict:
    """Task scores from the official script's output: the last `<task> ... <number>` line per task."""
    out = {}
    for line in text.splitlines():
        for t in tasks:
            m = re.search(rf"\b{re.escape(t)}\b\D*?(-?\d+(?:\.\d+)?)", line)
            if m:
                out[t] = float(m.group(1))
    return out


def run_official(contest: dict, script: Path, data_dir: Path, rdir: Path, host: str, port: int,
                 model: str) -> dict:
    """Run the official script; its scores are returned only when it exits 0 and reports some. A
    failed run is kept as accuracy.failed.json and accuracy.failed.log, which `forge score` ignores."""
    rdir.mkdir(parents=True, exist_ok=True)
    live = rdir / "accuracy.run.log"
    live.unlink(missing_ok=True)
    with ui.step(f"official accuracy script {script} (output: {paths.rel(live)})"):
        res = proc.run(["bash", str(script)], cwd=data_dir, log=live, check=False,
                       env={**loopback_env(), "HOST": host, "PORT": str(port), "MODEL_NAME": model})
    tasks = list(contest["accuracy"]["tasks"])
    scores = parse_official(live.read_text(errors="replace"), tasks)
    ok = res.returncode == 0 and bool(scores)
    log = rdir / ("accuracy.log" if ok else "accuracy.failed.log")
    os.replace(live, log)
    out = {"mode": "official", "script": str(script), "exit_code": res.returncode, "scores": scores,
           "log": str(log), "finished": runs.now_iso()}
    if not ok:
        runs.write_json(rdir / FAILED, out)
        why = f"exited {res.returncode}" if res.returncode else "printed no task score"
        kept = f"; the earlier {RESULT} is unchanged" if (rdir / RESULT).is_file() else ""
        raise ForgeError(f"the official accuracy script {script} {why}; nothing recorded as run {rdir.name}'s "
                         f"accuracy{kept} (output: {paths.rel(log)}, scores it printed: {paths.rel(rdir / FAILED)})",
                         hint="read the log, fix the cause (the server, DATA_DIR, what the script needs) and "
                              "rerun forge accuracy")
    (rdir / FAILED).unlink(missing_ok=True)
    (rdir / "accuracy.failed.log").unlink(missing_ok=True)
    missing = [t for t in tasks if t not in scores]
    if missing:
        ui.warn(f"the official script printed no score for {', '.join(missing)}; see {paths.rel(log)}")
    return out


def cmd_accuracy(args) -> int:
    contest = contest_mod.load_contest()
    args.force = options.forced(args.force)
    if args.a or args.b:
        if not (args.a and args.b):
            raise ForgeError("A/B mode needs both --a and --b")
        return ab(contest, args.a, args.b)
    if args.limit is not None and args.limit < 1:
        raise ForgeError(f"--limit {args.limit}: needs a number of records of at least 1")
    st = server_record.running_server() if args.port is None else None
    port = args.port or (st["port"] if st else serve.LOCKED_PORT)
    host = contest["server"]["host"]
    run_id = args.run_id or (st or {}).get("run_id") or runs.new_run_id("accuracy")
    rdir = runs.run_dir(run_id, create=False)
    result = rdir / RESULT
    if result.is_file() and not args.force and args.baseline:
        ui.info(f"{paths.rel(result)}: run {rdir.name} already has recorded accuracy results; comparing those "
                "with the baseline (--force evaluates again)")
        return ab(contest, [args.baseline], [str(rdir)])
    if result.is_file() and not args.force:
        try:
            prev = runs.read_json(result)
            lim = prev.get("limit")
            was = f" ({prev.get('mode')}, {f'first {lim} records per task' if lim else 'all records'})"
        except (ForgeError, AttributeError):
            was = ""
        records.guard_recorded(f"run {rdir.name}", f"recorded accuracy results{was} ({paths.rel(result)})",
                               doing="evaluating it again", force=args.force,
                               hint="use another --run-id, or compare them with --baseline RUN (or --a RUN --b RUN)")
    data_dir_s = args.data_dir or os.environ.get("DATA_DIR") or ""
    data_dir = Path(data_dir_s) if data_dir_s else None
    script = data_dir / contest["accuracy"]["script"] if data_dir else None
    official = bool(script and script.is_file() and not args.own)
    src = None
    if not official:
        src = Path(args.data) if args.data else data_dir
        if src is None or not src.is_dir():
            raise ForgeError("no accuracy data", hint="pass --data DIR with LongBench-format jsonl files, or DATA_DIR")
    model_name = contest["server"]["served_model_name"]
    if not serve.health_ok(f"http://{host}:{port}{contest['server']['health_path']}"):
        raise ForgeError(f"no server answers on {host}:{port}", hint="start it first: forge serve --profile P")
    if official:
        out = run_official(contest, script, data_dir, rdir, host, port, model_name)
    else:
        url = f"http://{host}:{port}/v1/chat/completions"
        ev = evaluate(contest, src, url, model_name, args.limit, rdir, force=args.force)
        out = {"mode": "forge", "data": str(src), "limit": args.limit, **ev, "finished": runs.now_iso()}
    runs.write_json(result, out)
    (rdir / PROGRESS).unlink(missing_ok=True)        # complete: accuracy.json holds every record's score
    for t, v in out["scores"].items():
        print(f"{t:<36} {v:7.2f}")
    ui.info(f"wrote {result}")
    if args.baseline:
        return ab(contest, [args.baseline], [str(rdir)])
    return 0


def _acc(run: str) -> dict:
    p = runs.resolve_run(run) / "accuracy.json"
    if not p.is_file():
        raise ForgeError(f"{p}: no accuracy results in that run", hint="run forge accuracy for it first")
    return score.read_accuracy(p)


def ab(contest: dict, a: list[str], b: list[str]) -> int:
    base, ours = _acc(a[0]), _acc(b[0])
    res = score.accuracy_factor(contest["scoring"], ours, base)
    if not res["applied"]:
        raise ForgeError(f"cannot compare: {res['note']}")
    print(f"{'task':<36} {'A':>8} {'B':>8} {'change':>8}")
    for t in res["tasks"]:
        print(f"{t:<36} {base[t]:8.2f} {ours[t]:8.2f} {100 * res['per_task_change'][t]:+7.2f}%")
    print(f"mean {res['baseline_mean']:.2f} -> {res['run_mean']:.2f}: relative loss "
          f"{100 * res['relative_loss']:.2f} % -> accuracy factor {res['factor']:.2f}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("accuracy", help="accuracy sets against the running server (official script or ours)",
                       description="With DATA_DIR holding run_accuracy.sh, run it and record its scores; otherwise "
                                   "evaluate LongBench-format jsonl (files named in configs/contest.yaml accuracy.tasks) "
                                   "by querying the server; each record's score is saved as it comes "
                                   "(accuracy.progress.jsonl), so a rerun with the same --run-id and settings "
                                   "resumes an interrupted evaluation. Results: reports/runs/<run-id>/accuracy.json, "
                                   "written only when complete and replaced only with --force; a failing official "
                                   "script is an error and its output is kept as accuracy.failed.log. "
                                   "--a RUN --b RUN compares two results: per-task change and accuracy factor.")
    p.add_argument("--data-dir", help="official data folder (default: $DATA_DIR)")
    p.add_argument("--data", help="folder of LongBench-format jsonl files for our evaluator")
    p.add_argument("--own", action="store_true", help="use our evaluator even when run_accuracy.sh is present")
    p.add_argument("--limit", type=int, help="first N records per task (quick checks)")
    p.add_argument("--run-id", help="run folder to write into (default: the running server's run)")
    p.add_argument("--port", type=options.port, default=None, help="server port (default: the running server's, else 8001)")
    p.add_argument("--force", action="store_true",
                   help="replace accuracy results already recorded in the run folder, and discard an unfinished "
                        "evaluation there made with other data or settings")
    p.add_argument("--baseline", help="after evaluating, compare with this run's accuracy.json")
    p.add_argument("--a", nargs=1, help="A/B mode: baseline run")
    p.add_argument("--b", nargs=1, help="A/B mode: candidate run")
    p.set_defaults(func=cmd_accuracy)
