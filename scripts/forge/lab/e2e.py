"""`forge e2e-gpu`: the end-to-end run on a GPU machine, from the bundle `make gpu-bundle` built.

One invocation: verify and install the bundle (harness build of the patched vLLM, extra wheels, model
directory), start each profile's server through the same code as `forge serve` (the profile's checked
command plus the harness's arguments: random weights, TRITON_ATTN, graph settings), all servers side
by side on the one GPU, then:
  1. warm each server (the first request compiles the Triton kernels; not measured);
  2. plumbing check: greedy completions of the same prompts from the first profile and from the
     reference profile (same random weights), compared token by token and by first-token logprobs;
  3. rounds of the contest's tiers through `vllm bench serve` (the project's bench loop), one prompt
     per tier and profile per round, tiers and profiles interleaved so every profile sees the same
     conditions; rounds continue while the deadline allows;
  4. fault check: the reference server is killed in the middle of a tier; the loop records the
     failed requests and the score marks the tier failed;
  5. per-profile results (rounds merged per tier), a proxy score of every profile against the
     reference measured in the same run (reference = 60.0; needs every tier), each request's TPOT
     saving beside the kernel benchmark's prediction (decode.{md,json}, as `forge e2e-decode`), and
     summary.{md,json}.
Results land in --out (default reports/e2e/<date>-<device>/); --pack FILE rewrites a .tar.gz of it
after every step, so a run cut short still returns what it finished.
"""

from __future__ import annotations

import datetime as dt
import functools
import http.client
import io
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from . import e2e_decode, gpu_bundle
from .. import paths, proc, ui
from ..run import bench, profiles, runs, score, serve, synth
from ..run import contest as contest_mod
from ..errors import ForgeError
from ..hashing import sha256_file

TRITON_PART_MIB = 15      # the parts of a packed Triton cache (what comes back from a machine per file)
TRITON_PARTS = "triton-cache.tgz"
TRITON_MANIFEST = "triton-cache.json"
CLIENT_TURN_S = 5.0       # a tier's client overhead over the bench's own duration (start, dataset, JSON)
FAULT_NEED_S = 40.0       # client start, a request cut after a few seconds, two failed tiers
DEFAULT_TIER_ORDER = ["16-32K", "8-16K", "4-8K"]   # the largest expected change first
WARM_PROMPT_TOKENS = 9000                          # one full 8192-token prefill chunk and a ragged one
PLUMBING_PROMPT_TOKENS = [1000, 4000, 12000]
PLUMBING_MAX_TOKENS = 32
FIRST_PORT = serve.LOCKED_PORT


# --- small HTTP client (no proxies: loopback only) --------------------------------------------------

def post_json(url: str, body: dict, timeout: float) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ForgeError(f"{url}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}")
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        raise ForgeError(f"{url}: {type(e).__name__}: {e}")


def complete(state: dict, prompt: str, max_tokens: int, *, logprobs: int | None = None,
             timeout: float = 600) -> dict:
    body = {"model": state["served_model_name"], "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    if logprobs:
        body["logprobs"] = logprobs
    return post_json(f"http://{state['host']}:{state['port']}/v1/completions", body, timeout)


# --- vLLM's client, imported once ------------------------------------------------------------------

class ClientWorker:
    """scripts/forge/lab/benchworker.py under `python`: one process runs every tier's `vllm bench serve`
    (vLLM's own parser and main), so the client's imports are paid once, not per tier."""

    def __init__(self, python: str, log: Path, timeout: float = 300):
        import queue
        from .benchworker import MARKER
        self.marker = MARKER
        self.log = log
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(paths.ROOT / "scripts") + os.pathsep + env.get("PYTHONPATH", "")
        self.err = open(log, "a")
        self.p = subprocess.Popen([python, "-m", "forge.lab.benchworker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, env=env, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        if self._reply(timeout) is None:
            self.close()
            raise ForgeError(f"the benchmark client worker did not start\n{proc.tail(log, 30)}",
                             hint="its log says why; --client-per-tier runs a fresh client per tier instead")

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith(self.marker):
                self.lines.put(line[len(self.marker):])
            else:
                self.err.write(line)
                self.err.flush()
        self.lines.put(None)

    def _reply(self, timeout: float) -> dict | None:
        import queue
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        return json.loads(line) if line else None

    def run(self, argv: list[str], log: Path, timeout: float = 1800) -> int:
        if self.p.poll() is not None:
            return 1
        try:
            self.p.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
            self.p.stdin.flush()
        except OSError:
            self.close()
            return 1
        r = self._reply(timeout)
        if r is None:                     # hung or died: never reuse it
            self.close()
            return 1
        return int(r.get("rc", 1))

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
                self.p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.p.pid, 9)
                self.p.wait()


def client_runner(run: "Run"):
    """How tiers run their client: a worker process when the client is this vLLM's own CLI module,
    else (a custom --client, or --client-per-tier) a fresh process per tier."""
    if run.args.client_per_tier:
        return None
    launcher = bench.client_launcher(run.args.client)
    if launcher[1:] != ["-m", "vllm.entrypoints.cli.main"]:
        return None
    pre = getattr(run, "worker_thread", None)
    if pre is not None and pre is not threading.current_thread():
        pre.join()                        # the worker started early, while the servers started
        run.worker_thread = None
    if getattr(run, "worker_failed", False):
        return None
    if getattr(run, "worker", None) is None or run.worker.p.poll() is not None:
        try:
            run.worker = ClientWorker(launcher[0], run.out / "logs" / "bench-worker.log")
        except ForgeError as e:
            run.worker_failed = True
            run.summary["skipped"].append(f"client worker: {e.message.splitlines()[0]}; a client per tier instead")
            return None

    def runner(argv: list[str], log: Path) -> int:
        w = run.worker
        if w.p.poll() is not None:
            try:
                run.worker = w = ClientWorker(launcher[0], run.out / "logs" / "bench-worker.log")
            except ForgeError:
                return 1
        return w.run(argv, log, timeout=max(5.0, run.left()))
    return runner


# --- merging rounds ----------------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float | None:
    return score.percentile(values, q) if values else None


def merge_results(parts: list[dict]) -> dict:
    """One tier result from several `vllm bench serve` results of the same tier (one per round):
    per-request lists concatenated, counts and durations summed, throughput and percentiles
    recomputed (at concurrency 1 the rounds are back to back, so tok/s = tokens / summed duration)."""
    if not parts:
        raise ForgeError("no tier results to merge")
    lists = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "start_times")
    out: dict = {"forge_merged_rounds": len(parts)}
    for k in lists:
        if all(k in p for p in parts):
            out[k] = [x for p in parts for x in p[k]]
    for k in ("completed", "failed", "num_prompts", "total_input_tokens", "total_output_tokens", "duration"):
        out[k] = sum(p.get(k) or 0 for p in parts)
    dur = out["duration"]
    out["output_throughput"] = out["total_output_tokens"] / dur if dur > 0 else 0.0
    out["request_throughput"] = out["completed"] / dur if dur > 0 else 0.0
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / dur if dur > 0 else 0.0
    ok = [i for i, e in enumerate(out.get("errors") or []) if not e] if "errors" in out else []
    ttfts_ms = [1000.0 * out["ttfts"][i] for i in ok] if "ttfts" in out else []
    tpots = score.request_tpots_ms(out) or []
    for name, vals in (("ttft", ttfts_ms), ("tpot", tpots)):
        for q in (50, 95, 99):
            out[f"p{q}_{name}_ms"] = _pct(vals, q)
        out[f"mean_{name}_ms"] = sum(vals) / len(vals) if vals else None
    synth_notes = [p["forge_synthesized"] for p in parts if p.get("forge_synthesized")]
    if synth_notes:
        out["forge_synthesized"] = "; ".join(synth_notes)
    return out


# --- plumbing ----------------------------------------------------------------------------------------

def _choice(resp: dict) -> dict:
    ch = (resp.get("choices") or [{}])[0]
    lp = ch.get("logprobs") or {}
    return {"text": ch.get("text", ""), "tokens": lp.get("tokens") or [],
            "token_logprobs": lp.get("token_logprobs") or [], "top": lp.get("top_logprobs") or []}


def compare_outputs(ref: dict, test: dict) -> dict:
    """Greedy outputs of two servers with the same weights: where the token streams part, and how far
    the first token's top logprobs moved, against their own spread."""
    rt, tt = ref["tokens"], test["tokens"]
    same = 0
    for a, b in zip(rt, tt):
        if a != b:
            break
        same += 1
    vals = [x for x in test["token_logprobs"] if x is not None]
    finite = all(math.isfinite(x) for x in vals) and all(
        math.isfinite(v) for d in test["top"] if d for v in d.values())
    r0 = ref["top"][0] if ref["top"] else {}
    t0 = test["top"][0] if test["top"] else {}
    common = sorted(set(r0) & set(t0))
    diffs = [abs(r0[k] - t0[k]) for k in common]
    spread = (max(r0.values()) - min(r0.values())) if len(r0) > 1 else None
    collapse_test = len(tt) > 4 and len(set(tt)) == 1
    collapse_ref = len(rt) > 4 and len(set(rt)) == 1
    gross = []
    if not tt:
        gross.append("no tokens")
    if not finite:
        gross.append("non-finite logprobs")
    if collapse_test and not collapse_ref:
        gross.append("one token repeated throughout (the reference does not)")
    if r0 and t0 and not common:
        gross.append("first-token top candidates share nothing with the reference")
    return {"tokens": len(tt), "same_prefix": same, "identical": rt == tt,
            "first_token_same": bool(rt and tt and rt[0] == tt[0]),
            "top_common": len(common), "top_k": len(r0),
            "max_abs_logprob_diff": max(diffs) if diffs else None,
            "ref_top_spread": spread, "finite": finite, "gross": gross}


def plumbing(test: dict, ref: dict, prompts: list[str], left=lambda: 600.0) -> dict:
    rows = []
    for p in prompts:
        a = _choice(complete(ref, p, PLUMBING_MAX_TOKENS, logprobs=5, timeout=max(5.0, left())))
        b = _choice(complete(test, p, PLUMBING_MAX_TOKENS, logprobs=5, timeout=max(5.0, left())))
        row = compare_outputs(a, b)
        row["prompt_words"] = len(p.split())
        row["ref_text"], row["test_text"] = a["text"][:200], b["text"][:200]
        rows.append(row)
    failed = [r for r in rows if r["gross"]]
    return {"test": test["profile"], "reference": ref["profile"], "max_tokens": PLUMBING_MAX_TOKENS,
            "prompts": rows, "ok": not failed,
            "verdict": "no gross mismatch" if not failed else
            "; ".join(f"{r['prompt_words']} words: {', '.join(r['gross'])}" for r in failed)}


# --- server log facts -------------------------------------------------------------------------------

LOG_FACTS = {
    "attention_block_size": r"[Ss]etting attention block size to (\d+) tokens",
    "kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "kv_cache_dtype": r"kv_cache_dtype=(\w+)",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
}


# logged as errors by vLLM but expected in the harness (the flash-attention probe; no extension shipped)
HARMLESS_LOG_LINES = ("Cannot use FA version",)


def log_facts(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.is_file() else ""
    out = {}
    for k, pat in LOG_FACTS.items():
        m = re.search(pat, text)
        if m:
            out[k] = m.group(1).replace(",", "")
    errs = [ln for ln in text.splitlines()
            if (re.search(r"Traceback|\bERROR\b", ln) or re.match(r"\s*[\w.]+(Error|Exception)\b", ln))
            and not any(h in ln for h in HARMLESS_LOG_LINES)]
    out["error_lines"] = errs[:10]
    return out


def trim_log(src: Path, dst: Path, head: int = 150, tail: int = 250) -> None:
    lines = src.read_text(errors="replace").splitlines() if src.is_file() else []
    if len(lines) > head + tail:
        lines = lines[:head] + [f"... [{len(lines) - head - tail} lines trimmed by forge e2e-gpu] ..."] + lines[-tail:]
    dst.write_text("\n".join(lines) + "\n")


# --- the run ------------------------------------------------------------------------------------------

class Run:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline_s
        self.contest = contest_mod.load_contest()
        self.h = gpu_bundle.harness_config(Path(args.harness) if args.harness else None)
        # what the arguments name is checked before anything is created, installed or started
        self.names = args.profiles.split(",") if args.profiles else list(self.h["profiles"])
        self.ref = args.reference or ("upstream" if "upstream" in self.names else self.names[-1])
        if self.ref not in self.names:
            raise ForgeError(f"the reference profile {self.ref} is not among the profiles {self.names}",
                             hint="add it to --profiles")
        self.profiles = {n: profiles.load_profile(n, self.contest) for n in self.names}
        known = contest_mod.tier_names(self.contest)
        unknown = [t for t in (args.tier_order or []) if t not in known]
        if unknown:
            raise ForgeError(f"--tier-order {','.join(args.tier_order)}: no tier named {', '.join(unknown)} "
                             "in configs/contest.yaml", hint=f"name tiers from: {', '.join(known)}")
        self.out = Path(args.out) if args.out else default_out()
        self.out.mkdir(parents=True, exist_ok=True)
        self.summary: dict = {"started": runs.now_iso(), "command": " ".join(["forge e2e-gpu", *sys.argv[2:]]),
                              "git": runs.git_commit(), "steps": [], "skipped": [], "harness": {}}
        self.servers: dict[str, dict] = {}
        self.lock = threading.RLock()     # the warm-up thread reports steps too
        prev_path = self.out / "summary.json"
        if prev_path.is_file():
            # resuming this folder: keep what earlier invocations did (finished rounds are kept too)
            prev = runs.read_json(prev_path)
            earlier = prev.pop("earlier_invocations", [])
            self.summary["earlier_invocations"] = earlier + [
                {k: prev.get(k) for k in ("started", "command", "seconds", "steps", "skipped", "server_facts",
                                          "server_errors", "error", "git", "bundle", "versions")}]
            for k in ("plumbing", "fault"):
                if prev.get(k) and prev[k].get("ok"):
                    self.summary[k] = {**prev[k], "from_earlier_invocation": prev.get("started")}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, name: str, **detail) -> None:
        with self.lock:
            rec = {"step": name, "at_s": round(time.monotonic() - self.t0, 1), **detail}
            self.summary["steps"].append(rec)
            ui.info(f"e2e [{rec['at_s']:.0f}s, {self.left():.0f}s left]: {name}")
            self.save()

    def save(self) -> None:
        """summary.json and summary.md as they stand, and the pack: after every step, so a run cut
        short by the machine's limit still returns them."""
        with self.lock:
            runs.write_json(self.out / "summary.json", self.summary)
            names, scored, ref = getattr(self, "final", None) or (
                self.summary.get("profiles") or [], {}, self.summary.get("reference") or "upstream")
            try:
                (self.out / "summary.md").write_text(render_summary(self, names, scored, ref))
            except Exception as e:        # the summary must never stop the run
                ui.warn(f"summary.md not written: {type(e).__name__}: {e}")
            if self.args.pack:
                try:
                    pack(self.out, Path(self.args.pack), self.servers)
                except OSError as e:
                    ui.warn(f"pack not written: {e}")


def default_out() -> Path:
    slug = re.sub(r"[^a-z0-9]+", "", device_name().lower().replace("nvidia", "")) or "device"
    return paths.REPORTS / "e2e" / f"{dt.date.today().isoformat()}-{slug[:16]}"


def _write_tgz(dest: Path, files: list[tuple[Path, str]], level: int = 9) -> None:
    """A .tar.gz of (file, name in the archive) pairs, written to a temporary name and renamed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        with tarfile.open(tmp, "w:gz", compresslevel=level) as tf:
            for path, arcname in files:
                tf.add(path, arcname=arcname)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def pack(out: Path, dest: Path, servers: dict) -> None:
    """A .tar.gz of the results folder (server logs trimmed, datasets left out), written atomically."""
    (out / "logs").mkdir(exist_ok=True)
    for name, st in servers.items():
        trim_log(Path(st["log"]), out / "logs" / f"server-{name}.log")
    _write_tgz(dest, [(p, str(Path(out.name) / p.relative_to(out))) for p in sorted(out.rglob("*"))
                      if p.is_file() and p.relative_to(out).parts[0] != "datasets" and p.name != "server.log"])


class _JoinedParts(io.RawIOBase):
    """Files read one after the other as one stream (a cut archive without a joined copy on disk)."""

    def __init__(self, files: list[Path]):
        super().__init__()
        self.files, self.cur = list(files), None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while True:
            if self.cur is None:
                if not self.files:
                    return 0
                self.cur = open(self.files.pop(0), "rb")
            n = self.cur.readinto(b)
            if n:
                return n
            self.cur.close()
            self.cur = None

    def close(self) -> None:
        if self.cur is not None:
            self.cur.close()
            self.cur = None
        super().close()


def seed_triton_cache(src: Path, cache: Path) -> dict:
    """Unpack the parts `pack_triton_cache` wrote (checked against their manifest) into the cache
    directory. Kernels are keyed by source, options and device, so a cache from another machine of the
    same kind is reused and anything else is compiled again. A damaged or incomplete set is skipped with
    a warning (the cache only saves time); a folder without parts is an error (a wrong path)."""
    man_path = src / TRITON_MANIFEST
    if not man_path.is_file():
        raise ForgeError(f"--triton-cache-from {src}: no {TRITON_MANIFEST} there",
                         hint="give the folder an earlier run's --triton-cache-pack wrote (its parts and "
                              f"{TRITON_MANIFEST}), or leave the option out")
    man = runs.read_json(man_path)
    parts = [src / x["name"] for x in man.get("parts", [])]
    bad = [p.name for p, x in zip(parts, man.get("parts", []))
           if not p.is_file() or p.stat().st_size != x.get("bytes") or sha256_file(p) != x.get("sha256")]
    if bad or not parts:
        ui.warn(f"Triton cache parts in {src} do not match {TRITON_MANIFEST} ({', '.join(bad) or 'no parts'}); "
                "starting with an empty cache")
        return {"from": str(src), "skipped": f"parts missing or changed: {', '.join(bad) or 'none listed'}"}
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".seed-", dir=cache))
    n = 0
    try:
        with _JoinedParts(parts) as raw, tarfile.open(fileobj=io.BufferedReader(raw), mode="r|gz") as tf:
            for m in tf:
                if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in Path(m.name).parts:
                    continue                   # only plain files and folders inside the cache
                tf.extract(m, tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
                n += m.isfile()
        for entry in tmp.iterdir():            # complete: move into place (what is there already stays)
            if not (cache / entry.name).exists():
                os.replace(entry, cache / entry.name)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        ui.warn(f"Triton cache parts in {src} could not be unpacked ({type(e).__name__}: {e}); "
                "starting with an empty cache")
        return {"from": str(src), "skipped": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"from": str(src), "parts": len(parts), "files": n}


def pack_triton_cache(cache: Path, dest: Path, part_mib: float = TRITON_PART_MIB) -> dict:
    """The cache directory as a .tar.gz cut into parts of at most part_mib MiB (DIR/triton-cache.tgz.000,
    .001, ...) plus DIR/triton-cache.json (the parts, their sizes and sha256). The archive is complete
    before any earlier pack in DIR is replaced."""
    dest.mkdir(parents=True, exist_ok=True)
    whole = dest / f".{TRITON_PARTS}.whole"
    _write_tgz(whole, [(p, str(p.relative_to(cache))) for p in sorted(cache.rglob("*")) if p.is_file()], level=6)
    step = max(1, int(part_mib * 1024 * 1024))
    made = []
    try:
        with open(whole, "rb") as f:
            while chunk := f.read(step):
                tmp = dest / f".{TRITON_PARTS}.{len(made):03d}.part"
                tmp.write_bytes(chunk)
                made.append(tmp)
        size = whole.stat().st_size
        for old in dest.glob(f"{TRITON_PARTS}.*"):
            old.unlink()
        parts = []
        for i, tmp in enumerate(made):
            final = dest / f"{TRITON_PARTS}.{i:03d}"
            os.replace(tmp, final)
            parts.append({"name": final.name, "bytes": final.stat().st_size, "sha256": sha256_file(final)})
        runs.write_json(dest / TRITON_MANIFEST, {"parts": parts, "bytes": size, "from": str(cache)})
    finally:
        whole.unlink(missing_ok=True)
        for tmp in made:
            tmp.unlink(missing_ok=True)
    return {"to": str(dest), "parts": len(parts), "mib": round(size / 2**20, 1)}


def install_bundle(bundle: Path, site: Path) -> dict:
    man = gpu_bundle.verify_bundle(bundle)
    marker = site / ".forge-bundle"
    wheels = sorted(str(bundle / n) for n in man["files"] if n.startswith("wheels/") and n.endswith(".whl"))
    key = json.dumps({n: e["sha256"] for n, e in man["files"].items() if n.startswith("wheels/")}, sort_keys=True)
    if marker.is_file() and marker.read_text() == key:
        ui.info(f"bundle already installed in {site}")
    else:
        shutil.rmtree(site, ignore_errors=True)
        with ui.step(f"installing {len(wheels)} wheels into {site}"):
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                "--no-cache-dir", "--target", str(site), *wheels], capture_output=True, text=True)
            if r.returncode != 0:
                raise ForgeError(f"pip could not install the bundle:\n{r.stderr[-2000:]}",
                                 hint="the bundle is built for Python " + man.get("python", "?"))
        marker.write_text(key)
    return man


def python_env(site: Path | None) -> None:
    """Children (servers, the bench client) import the bundle's vLLM first."""
    if site:
        old = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = str(site) + (os.pathsep + old if old else "")


def versions(py: str) -> dict:
    code = ("import json,sys\nout={'python':sys.version.split()[0]}\n"
            "for m in ('torch','triton','vllm','transformers'):\n"
            "  try:\n    out[m]=__import__(m).__version__\n  except Exception as e:\n    out[m]=f'unavailable: {e}'\n"
            "try:\n  import torch\n  out['device']=torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'\n"
            "except Exception:\n  pass\nprint(json.dumps(out))")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": r.stderr[-500:]}


def harness_contest(contest: dict, fixed_output: int | None = None) -> dict:
    """The contest's client options with the harness's two time savers: no warm-up requests and no
    initial test request (each costs a full request per tier; the servers are warmed once, before
    any tier). Output lengths: each prompt's own (the contest workload, --custom-output-len -1) or
    `fixed_output` tokens for every request; end-of-text is ignored either way (random weights)."""
    c = json.loads(json.dumps(contest))
    opts = []
    for o in c["client"]["options"]:
        if o[0] == "--num-warmups":
            o = ["--num-warmups", "0"]
        elif o[0] == "--custom-output-len":
            o = ["--custom-output-len", str(fixed_output) if fixed_output else "-1"]
        opts.append(o)
    opts.append(["--ignore-eos"])
    opts.append(["--ready-check-timeout-sec", "0"])
    c["client"]["options"] = opts
    return c


def harness_args(h: dict, extra: list[str]) -> list[str]:
    out = [x for a in h["server_args"] for x in a]
    out += ["--gpu-memory-utilization", str(h["gpu_memory_utilization"])]
    if h.get("kv_cache_memory_bytes"):
        out += ["--kv-cache-memory-bytes", str(h["kv_cache_memory_bytes"])]
    return out + extra


def build_datasets(run: Run, model: Path, n: int) -> dict[str, list[Path]]:
    """The same synthetic prompts for every profile: per tier, one file per round (one prompt each).
    By default n requests of the contest workload (configs/workload.yaml; evenly spaced by output
    length), each with its own output length; with --fixed-output, prompts across the tier's range."""
    ddir = run.out / "datasets"
    per_round: dict[str, list[Path]] = {}
    fixed = getattr(run.args, "fixed_output", None)
    workload = None if fixed else synth.load_workload(run.contest)
    for t in run.contest["tiers"]:
        full = ddir / f"{t['name']}.jsonl"
        if fixed:
            info = synth.build_tier(model, t, n, full)
        else:
            pairs = synth.stratified(workload["tiers"][t["name"]]["requests"], n)
            info = synth.build_workload_tier(model, t["name"], pairs, full)
            info["requests"] = [list(x) for x in pairs]
        lines = full.read_text().splitlines()
        per_round[t["name"]] = []
        for r, line in enumerate(lines, 1):
            p = ddir / f"r{r}" / f"{t['name']}.jsonl"
            p.parent.mkdir(exist_ok=True)
            p.write_text(line + "\n")
            per_round[t["name"]].append(p)
        run.summary.setdefault("datasets", {})[t["name"]] = {
            "prompt_tokens": info["prompt_tokens"], "seed": info["seed"],
            "shape": f"{fixed} output tokens per request" if fixed else "contest workload (configs/workload.yaml)",
            **({"requests": info["requests"]} if not fixed else {})}
    return per_round


def synthetic_prompt(model: Path, n_tokens: int, seed: str) -> str:
    tok = synth.Tok(model)
    text, _ = synth.make_prompt(tok, synth.word_pool(tok), n_tokens, random.Random(seed))
    return text


def start_all(run: Run, model: Path, names: list[str], site: Path | None) -> list[str]:
    """Start the servers side by side; returns the profiles whose server came up. With a fixed
    KV-cache size (no memory profiling) they all start at once and warm up together; otherwise the
    first starts alone (its memory profile must not see another process allocating) and the others
    start while it compiles its kernels on its first request."""
    if run.h.get("kv_cache_memory_bytes"):
        return start_all_at_once(run, model, names)
    live: list[str] = []
    waited: set[str] = set()
    warm_thread = None
    for i, name in enumerate(names):
        st = _launch(run, model, name, i)
        if st is None:
            continue
        if warm_thread is None:           # no server is up yet: this one starts alone
            waited.add(name)
            if guarded(run, name, wait_ready, run, name):
                live.append(name)
                warm_thread = threading.Thread(target=guarded, args=(run, name, warm, run, name, model), daemon=True)
                warm_thread.start()
    for name in names:
        if name in run.servers and name not in waited:
            waited.add(name)
            if guarded(run, name, wait_ready, run, name):
                live.append(name)
    if warm_thread is not None:
        warm_thread.join()
    for name in live[1:]:
        guarded(run, name, warm, run, name, model)
    return [n for n in names if n in live]


def _launch(run: Run, model: Path, name: str, i: int) -> dict | None:
    args = run.args
    extra_env = {"VLLM_LOGGING_LEVEL": "INFO"}
    if args.triton_cache:
        extra_env["TRITON_CACHE_DIR"] = args.triton_cache
    hargs = run.hargs
    run.summary["harness"] = {"server_args": hargs, "env": extra_env}
    prof = run.profiles[name]
    st = guarded(run, name, functools.partial(
        serve.start_server, prof, model, contest=run.contest, port=args.first_port + i, run_id=name,
        vllm_cmd=args.vllm, wait=False, state_file=run.out / "state" / f"{name}.json",
        harness_args=hargs, extra_env=extra_env))
    if st is not None:
        st["t_start"] = time.monotonic()
        run.servers[name] = st
    return st


def start_all_at_once(run: Run, model: Path, names: list[str]) -> list[str]:
    for i, name in enumerate(names):
        _launch(run, model, name, i)
    live = [n for n in names if n in run.servers and guarded(run, n, wait_ready, run, n)]
    threads = [threading.Thread(target=guarded, args=(run, n, warm, run, n, model), daemon=True) for n in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return live


def guarded(run: Run, name: str, fn, *a):
    """Run one step for server `name`; a failure is recorded against that server (its log is kept)
    and the run goes on with the others."""
    try:
        return fn(*a)
    except Exception as e:            # recorded against the server; KeyboardInterrupt still ends the run
        msg = e.message if isinstance(e, ForgeError) else f"{type(e).__name__}: {e}"
        with run.lock:
            run.summary.setdefault("server_errors", {}).setdefault(name, []).append(msg[-3000:])
            what = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "step")
            run.step(f"server {name}: {what} failed", error=msg[-500:])
        return None


def wait_ready(run: Run, name: str) -> bool:
    st = run.servers[name]
    serve.wait_healthy(st["popen"], st, timeout=max(5.0, run.left()))
    st["ready_s"] = round(time.monotonic() - st["t_start"], 1)
    run.step(f"server {name} ready", seconds=st["ready_s"], port=st["port"], **log_facts(Path(st["log"])))
    return True


def warm(run: Run, name: str, model: Path) -> None:
    st = run.servers[name]
    t = time.monotonic()
    prompt = synthetic_prompt(model, WARM_PROMPT_TOKENS, "warm")
    complete(st, prompt, 16, timeout=max(5.0, run.left()))
    st["warm_s"] = round(time.monotonic() - t, 1)
    run.step(f"server {name} warmed (first request: Triton compile and autotune)", seconds=st["warm_s"])


def round_identity(run: Run, dataset: Path) -> dict:
    """What makes two results of one (round, tier) comparable across invocations of one folder."""
    return {"dataset_sha256": sha256_file(dataset), **run.identity}


def kept_round(run: Run, rdir: Path, tname: str, ident: dict) -> bool:
    """A finished round from an earlier invocation is kept when it was measured (not recorded as
    failed for a missing server) with the same prompts, bundle, server arguments and device."""
    if not bench.tier_done(rdir, tname, keep_failed=True):
        return False
    if runs.read_json(bench.result_path(rdir, tname)).get("forge_synthesized"):
        return False
    idf = rdir / f"{tname}.identity.json"
    prev = runs.read_json(idf) if idf.is_file() else None
    if prev != ident:
        words = {"dataset_sha256": "prompts", "bundle_wheel_sha256": "bundle", "server_args": "server arguments",
                 "device": "device"}
        diff = sorted(words.get(k, k) for k in set(ident) | set(prev or {}) if (prev or {}).get(k) != ident.get(k))
        raise ForgeError(f"{rdir}: an earlier invocation ran tier {tname} on other {', '.join(diff) or 'settings'}",
                         hint="give a new --out folder, or the same bundle, --num-prompts and server arguments")
    return True


def check_resume(run: Run, names: list[str], datasets: dict[str, list[Path]]) -> None:
    """Refuse, before any server starts, a folder whose finished rounds are not comparable."""
    for name in names:
        for tname, files in datasets.items():
            for r, ds in enumerate(files, 1):
                kept_round(run, runs.run_dir(name, create=False) / "rounds" / f"r{r}", tname, round_identity(run, ds))


def rounds_reserve(args, summary: dict, live: list[str]) -> float:
    """Seconds the tier rounds leave before the deadline: --reserve-s, plus the fault check's need
    while it is still to run (not --no-fault, not kept from an earlier invocation, reference up)."""
    pending = not args.no_fault and not summary.get("fault") and summary.get("reference") in live
    return args.reserve_s + (FAULT_NEED_S if pending else 0.0)


def bench_rounds(run: Run, names: list[str], model: Path, datasets: dict[str, list[Path]]) -> dict:
    """Rounds of (tier, profile) pairs, interleaved; returns {profile: {tier: {round: result file}}}.
    A (round, tier) is started for every profile or for none, so the profiles are compared on the
    same prompts."""
    contest_h = harness_contest(run.contest, getattr(run.args, "fixed_output", None))
    tiers = {t["name"]: t for t in run.contest["tiers"]}
    order = [t for t in (run.args.tier_order or DEFAULT_TIER_ORDER) if t in tiers]
    launcher = bench.client_launcher(run.args.client)
    runner = client_runner(run)
    done: dict[str, dict[str, dict[int, Path]]] = {n: {t: {} for t in order} for n in names}
    est = {t: None for t in order}
    reserve = rounds_reserve(run.args, run.summary, names)
    n_rounds = max(len(v) for v in datasets.values())
    for r in range(1, n_rounds + 1):
        for tname in order:
            ident = round_identity(run, datasets[tname][r - 1])
            todo = []
            for name in names:
                rdir = runs.run_dir(name) / "rounds" / f"r{r}"
                rdir.mkdir(parents=True, exist_ok=True)
                if kept_round(run, rdir, tname, ident):
                    done[name][tname][r] = bench.result_path(rdir, tname)
                    # what a served round took then is the best guess for this tier's later rounds
                    kept = runs.read_json(done[name][tname][r])
                    if kept.get("completed") and not kept.get("failed") and \
                            isinstance(kept.get("duration"), (int, float)):
                        est[tname] = max(est[tname] or 0.0, kept["duration"] + CLIENT_TURN_S)
                    run.step(f"round {r} tier {tname} {name}: kept from an earlier invocation")
                else:
                    todo.append((name, rdir))
            if not todo:
                continue
            # before a tier's first measurement (here or in a kept round): 1024 tokens at ~25 ms, the
            # prefill, the client's turn
            guess = (est[tname] or (30.0 + tiers[tname]["prompt_tokens"][1] / 4000.0)) * len(todo)
            if run.left() - reserve < guess:
                run.summary["skipped"].append(f"round {r} tier {tname} ({', '.join(n for n, _ in todo)}): "
                                              f"{run.left():.0f}s left, needs ~{guess:.0f}s + {reserve:.0f}s reserve")
                continue
            for name, rdir in todo:
                st = run.servers[name]
                runs.write_json(rdir / f"{tname}.identity.json", ident)
                man = {"run_id": f"{name}-r{r}", "profile": name, "round": r, **run.identity}
                ds = {"kind": "synthetic", "path": str(datasets[tname][r - 1]), "num_prompts": 1}
                t = time.monotonic()
                status = guarded(run, name, functools.partial(
                    bench.run_tier, contest_h, tiers[tname], ds, launcher=launcher, model=str(model), host=st["host"],
                    port=st["port"], rdir=rdir, manifest=man, poll_s=30, runner=runner,
                    health_url=f"http://{st['host']}:{st['port']}{st['health']}"))
                took = time.monotonic() - t
                if status is None:
                    continue
                est[tname] = max(est[tname] or 0.0, took)
                res = runs.read_json(bench.result_path(rdir, tname))
                done[name][tname][r] = bench.result_path(rdir, tname)
                run.step(f"round {r} tier {tname} {name}: {res.get('output_throughput', 0):.2f} tok/s",
                         status=status, seconds=round(took, 1), completed=res.get("completed"),
                         failed=res.get("failed"), ttft_ms=res.get("p99_ttft_ms"), tpot_ms=res.get("p99_tpot_ms"))
    return done


def finish_runs(run: Run, names: list[str], done: dict) -> dict[str, Path]:
    """Merge each profile's rounds into reports-style run folders (one <tier>.json per tier), over the
    rounds every profile has for that tier: the profiles' figures then cover the same prompts."""
    out = {}
    for name in names:
        rdir = runs.run_dir(name)
        used = {}
        for tname in done[name]:
            common = sorted(set.intersection(*(set(done[n][tname]) for n in names)))
            used[tname] = common
            final = bench.result_path(rdir, tname)
            if common:
                runs.write_json(final, merge_results([runs.read_json(done[name][tname][r]) for r in common]))
            elif final.is_file():
                final.unlink()            # a merge from an earlier invocation that no longer holds
            extra = sorted(set(done[name][tname]) - set(common))
            if extra:
                run.summary["skipped"].append(f"{name} tier {tname}: round(s) {extra} left out of the merge "
                                              "(not every profile has them)")
        st = run.servers.get(name, {})
        runs.write_json(rdir / "manifest.json", {
            "run_id": name, "profile": name, "harness": True, "model": st.get("model"),
            "server": runs.read_json(rdir / "serve.json") if (rdir / "serve.json").is_file() else None,
            "git": runs.git_commit(), "device": runs.device_info(), **run.identity,
            "client": "vllm bench serve (contest options; --num-warmups 0, --ready-check-timeout-sec 0)",
            "rounds": {t: [f"rounds/r{r}/{t}.json" for r in used[t]] for t in used}})
        out[name] = rdir
    return out


def scores(run: Run, run_dirs: dict[str, Path], ref: str) -> dict:
    tiers = contest_mod.tier_names(run.contest)
    complete_runs = {n: d for n, d in run_dirs.items() if all(bench.result_path(d, t).is_file() for t in tiers)}
    out = {}
    if ref not in complete_runs:
        run.summary["score_note"] = f"no proxy score: the reference {ref} lacks a result for some tier"
        return out
    base = score.baseline_from_run(complete_runs[ref], run.contest)
    base["label"] = f"{ref} measured in this run (H200 proxy: {ref} = 60.0)"
    dead = [t for t, m in base["tiers"].items() if not m["tok_s"] > 0]
    if dead:
        run.summary["score_note"] = (f"no proxy score: the reference {ref} served nothing in tier(s) "
                                     f"{', '.join(dead)} (see its server log)")
        return out
    for name, d in complete_runs.items():
        loaded = score.load_run(d, run.contest)
        drift = score.output_drift(loaded, base) if name != ref else None
        # this run's own folders, re-merged from its rounds on every invocation: their scores are redone
        out[name], _ = score.write_report(run.contest, d, loaded, base, drift, shown=str(d.relative_to(run.out)),
                                          force=True)
    return out


def fault_check(run: Run, name: str, model: Path, datasets: dict) -> dict:
    """Kill `name`'s server while a tier's request is in flight, then let the loop go on: the killed
    request must be recorded failed, the tiers after it failed without waiting, and the score must
    zero them all."""
    st = run.servers[name]
    health = f"http://{st['host']}:{st['port']}{st['health']}"
    if not serve.health_ok(health):
        raise ForgeError(f"fault check: the {name} server was already down before the check")
    contest_h = harness_contest(run.contest, getattr(run.args, "fixed_output", None))
    tiers = run.contest["tiers"]
    rid = f"fault-{name}"
    rdir = runs.run_dir(rid)
    for old in rdir.glob("*.json"):
        old.unlink()
    man = {"run_id": rid, "profile": name, "fault_check": True, "harness": True}
    launcher = bench.client_launcher(run.args.client)
    statuses: dict = {}
    server_log = Path(st["log"])
    posts_before = server_log.read_text(errors="replace").count("POST /v1/chat/completions")
    stop = threading.Event()

    def killer():
        # wait until the server has taken the tier's request (its access log shows the POST), then
        # kill the server's whole process group while the reply is streaming
        t = time.monotonic()
        while time.monotonic() - t < 60 and not stop.is_set():
            if server_log.read_text(errors="replace").count("POST /v1/chat/completions") > posts_before:
                break
            time.sleep(0.2)
        if stop.wait(run.args.fault_delay_s):
            return
        if proc.process_start_time(st["pid"]) == st["start_time"]:      # still our server
            os.killpg(st["pgid"], 9)
            statuses["killed_at_s"] = round(time.monotonic() - t, 1)

    k = threading.Thread(target=killer, daemon=True)
    k.start()
    try:
        for t in tiers:
            ds = {"kind": "synthetic", "path": str(datasets[t["name"]][0]), "num_prompts": 1}
            statuses[t["name"]] = bench.run_tier(contest_h, t, ds, launcher=launcher, model=str(model),
                                                 host=st["host"], port=st["port"], rdir=rdir, manifest=man,
                                                 health_url=health, poll_s=30, runner=client_runner(run))
    finally:
        stop.set()
        k.join(timeout=5)
    st["popen"].poll()
    res = {t["name"]: runs.read_json(bench.result_path(rdir, t["name"])) for t in tiers}
    ref_dir = runs.run_dir(name)
    verdict = {}
    if all(bench.result_path(ref_dir, t["name"]).is_file() for t in tiers):
        base = score.baseline_from_run(ref_dir, run.contest)
        if all(m["tok_s"] > 0 for m in base["tiers"].values()):
            base["label"] = f"{name} measured in this run, before the fault (H200 proxy: {name} = 60.0)"
            loaded = score.load_run(rdir, run.contest)
            sc, _ = score.write_report(run.contest, rdir, loaded, base, score.output_drift(loaded, base),
                                       shown=str(rdir.relative_to(run.out)))
            verdict = {n: {"contribution": t["contribution"], "zeroed_by": t["zeroed_by"]}
                       for n, t in sc["tiers"].items()}
    first = tiers[0]["name"]
    ok = ("killed_at_s" in statuses and statuses[first] in ("done", "server-died")
          and all((r.get("failed") or 0) >= 1 and not r.get("completed") for r in res.values())
          and all(statuses[t["name"]] == "server-down" for t in tiers[1:])
          and (not verdict or all(v["contribution"] == 0 for v in verdict.values())))
    return {"server": name, "statuses": statuses,
            "failed": {n: r.get("failed") for n, r in res.items()},
            "completed": {n: r.get("completed") for n, r in res.items()},
            "score": verdict, "ok": ok}


def tier_ratio_lines(run: Run, names: list[str], ref: str) -> list[str]:
    """Per tier and profile: mean TTFT and TPOT, the TTFT share of the tier's wall time, the ratios to
    the reference, and what `forge predict` makes of those ratios on the DCU."""
    from ..run import predict
    tiers = contest_mod.tier_names(run.contest)
    rows, ratios = [], {}
    for t in tiers:
        ref_m = None
        if bench.result_path(runs.run_dir(ref), t).is_file():
            try:
                ref_m = predict.run_means(runs.run_dir(ref), t)
            except ForgeError:
                pass
        for n in names:
            p = bench.result_path(runs.run_dir(n), t)
            if not p.is_file():
                continue
            try:
                mt, mp = predict.run_means(runs.run_dir(n), t)
            except ForgeError:
                continue
            r = runs.read_json(p)
            ok = [i for i, e in enumerate(r.get("errors") or []) if not e]
            dur = r.get("duration") or 0
            share = sum(r["ttfts"][i] for i in ok) / dur if dur and r.get("ttfts") else None
            rt = mt / ref_m[0] if ref_m else None
            rp = mp / ref_m[1] if ref_m else None
            if rt and rp:
                ratios.setdefault(n, {})[t] = (rt, rp)
            rows.append(f"| {t} | {n} | {mt / 1000:.2f} | {score._fmt(share and 100 * share, '.0f')} % | {mp:.1f} "
                        f"| {score._fmt(rt, '.3f')} | {score._fmt(rp, '.3f')} |")
    if not rows:
        return []
    L = ["", f"## Per tier: TTFT share of wall time and ratios to {ref}", "",
         f"| tier | profile | mean TTFT s | TTFT share | mean TPOT ms | TTFT ratio | TPOT ratio |",
         "|---|---|---|---|---|---|---|", *rows]
    preds = []
    try:
        w = synth.load_workload(run.contest)
        for n, per in ratios.items():
            if n == ref or set(per) != set(tiers):
                continue
            pred = predict.predict_from_ratios(w, {t: per[t][0] for t in tiers}, {t: per[t][1] for t in tiers})
            res = predict.score_prediction(run.contest, w, pred, "official")
            preds.append(f"- {n}: **{res['display']}** against the official baseline ("
                         + " / ".join(f"{pred[t]['tok_s']:.2f}" for t in tiers) + " tok/s)")
    except ForgeError as e:
        preds.append(f"- not computed: {e.message}")
    if preds:
        L += ["", "DCU prediction from these ratios (`forge predict --e2e`; assumes the ratios carry over to the "
                  "DCU, applied to the official upstream run's mean TTFT and TPOT):", "", *preds]
    return L


def render_summary(run: Run, names: list[str], scored: dict, ref: str) -> str:
    s = run.summary
    v = s.get("versions", {})
    # a copy of the repository without .git (as sent to a GPU machine) knows its commit from the bundle
    commit, dirty, where = s["git"].get("commit"), s["git"].get("dirty"), "this checkout"
    if not commit:
        fb = (s.get("bundle") or {}).get("forge") or {}
        commit, dirty, where = fb.get("commit"), fb.get("dirty"), "as recorded in the bundle"
    L = ["<!-- generated by `forge e2e-gpu` (scripts/forge/lab/e2e.py); do not edit -->",
         f"# End-to-end run: {', '.join(names)} on {v.get('device', '?')}", "",
         f"- started {s['started']}, {s.get('seconds', '?')} s; command: `{s['command']}`",
         f"- forge commit `{(commit or '?')[:12]}`{' (dirty)' if dirty else ''} ({where}); "
         f"bundle vLLM `{s.get('bundle', {}).get('version', '?')}`",
         f"- Python {v.get('python')}, torch {v.get('torch')}, triton {v.get('triton')}, "
         f"transformers {v.get('transformers')}",
         "- harness, not a contest run: random weights (`--load-format dummy`), plain-torch stand-ins for "
         "vLLM's compiled ops, client without warm-up/test requests (servers warmed once before the tiers; "
         "vLLM's own client code, run for all tiers in one process unless --client-per-tier); "
         "compare profiles only within this run.", ""]
    for e in s.get("earlier_invocations", []):
        L.append(f"- earlier invocation in this folder: started {e.get('started')}, {e.get('seconds')} s "
                 f"(its steps are in summary.json)")
    L += ["", "## Servers", "", "| profile | ready s | first request s | attention block | KV cache tokens | errors in log |",
          "|---|---|---|---|---|---|"]
    for n in names:
        st = run.servers.get(n, {})
        f = log_facts(Path(st["log"])) if st.get("log") else {}
        L.append(f"| {n} | {st.get('ready_s', '—')} | {st.get('warm_s', '—')} | {f.get('attention_block_size', '—')} "
                 f"| {f.get('kv_cache_tokens', '—')} | {len(f.get('error_lines', []))} |")
    shape = next((d.get("shape") for d in (s.get("datasets") or {}).values() if d.get("shape")), None)
    L += ["", f"## Tiers (output tok/s, concurrency 1, {shape or 'prompts as in summary.json datasets'})", "",
          "| tier | " + " | ".join(names) + " | best vs " + ref + " | TTFT P99 ms | TPOT P99 ms | prompts |",
          "|---|" + "---|" * len(names) + "---|---|---|---|"]
    for t in contest_mod.tier_names(run.contest):
        cells, tok = [], {}
        ttft, tpot, nprompt = [], [], []
        for n in names:
            p = bench.result_path(runs.run_dir(n), t)
            if p.is_file():
                r = runs.read_json(p)
                tok[n] = r.get("output_throughput") or 0.0
                cells.append(f"{tok[n]:.2f}" + (f" ({r['failed']} failed)" if r.get("failed") else ""))
                ttft.append(f"{n}: {score._fmt(r.get('p99_ttft_ms'), '.0f')}")
                tpot.append(f"{n}: {score._fmt(r.get('p99_tpot_ms'))}")
                nprompt.append(str(r.get("completed", 0) + r.get("failed", 0)))
            else:
                cells.append("—")
        best = max((x for x in tok.items() if x[0] != ref), key=lambda x: x[1], default=None)
        lift = f"{best[0]} {100 * (best[1] / tok[ref] - 1):+.1f} %" if best and tok.get(ref) else "—"
        L.append(f"| {t} | " + " | ".join(cells) + f" | {lift} | {'; '.join(ttft)} | {'; '.join(tpot)} | "
                 f"{'/'.join(nprompt) or '—'} |")
    L += tier_ratio_lines(run, names, ref)
    L += ["", "## Proxy score (same-run reference = 60.0)", ""]
    if scored:
        for n, r in scored.items():
            L.append(f"- {n}: **{r['display']}** (pooled TPOT P99 {score._fmt(r['tpot_p99_pooled_ms'])} ms)")
    else:
        L.append(f"- not computed: {s.get('score_note', 'tiers missing')}")
    if s.get("plumbing"):
        p = s["plumbing"]
        L += ["", f"## Plumbing check: {p['test']} vs {p['reference']} (greedy, {p['max_tokens']} tokens)"
              + (f" — from the invocation of {p['from_earlier_invocation']}" if p.get("from_earlier_invocation") else ""), "",
              f"Verdict: **{p['verdict']}**", "",
              "| prompt words | identical | same prefix | first token same | top-5 common | max Δ logprob | ref top-5 spread |",
              "|---|---|---|---|---|---|---|"]
        for r in p["prompts"]:
            L.append(f"| {r['prompt_words']} | {r['identical']} | {r['same_prefix']}/{r['tokens']} | "
                     f"{r['first_token_same']} | {r['top_common']}/{r['top_k']} | "
                     f"{score._fmt(r['max_abs_logprob_diff'], '.4f')} | {score._fmt(r['ref_top_spread'], '.4f')} |")
    if s.get("fault"):
        f = s["fault"]
        L += ["", f"## Fault check ({f['server']} killed mid-tier)"
              + (f" — from the invocation of {f['from_earlier_invocation']}" if f.get("from_earlier_invocation") else ""), "",
              f"Result: **{'as intended' if f['ok'] else 'NOT as intended'}** — statuses {f['statuses']}; "
              f"failed {f['failed']}; score contributions "
              f"{ {n: v['contribution'] for n, v in f['score'].items()} if f['score'] else 'not scored'}"]
    if s.get("server_errors"):
        L += ["", "## Server errors", ""]
        for n, errs in s["server_errors"].items():
            L += [f"### {n}", "", "```", errs[-1][-2500:], "```", ""]
    if s["skipped"]:
        L += ["", "## Left out", ""] + [f"- {x}" for x in s["skipped"]]
    if s.get("error"):
        L += ["", "## Error", "", "```", s["error"], "```"]
    return "\n".join(L) + "\n"


def stop_stale_servers(out: Path) -> None:
    """Servers an interrupted invocation of this folder left running (a killed run cannot stop
    them: they run in their own sessions) would hold the GPU and the ports."""
    for sf in sorted((out / "state").glob("*.json")):
        try:
            st = runs.read_json(sf)
        except ForgeError:
            sf.unlink()
            continue
        if proc.process_start_time(st["pid"]) == st["start_time"]:
            ui.warn(f"stopping the {st.get('profile')} server an earlier invocation left running (pid {st['pid']})")
            serve.stop_server(st, quiet=True)
        sf.unlink(missing_ok=True)


def stop_all(servers: dict) -> None:
    """Stop the servers at once (each gets a short grace), so the end of a run stays short."""
    ts = [threading.Thread(target=serve.stop_server, args=(st, True, 5.0)) for st in servers.values()]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def device_name() -> str:
    dev = runs.device_info()
    for tool in ("nvidia-smi", "hy-smi", "rocm-smi"):
        if dev.get(tool):
            return dev[tool].strip().splitlines()[0].split(",")[0].strip()
    return "cpu"


def cmd_e2e(args) -> int:
    import signal
    run = Run(args)
    names, ref = run.names, run.ref
    os.environ["FORGE_RUNS_DIR"] = str(run.out / "runs")
    (run.out / "logs").mkdir(exist_ok=True)
    stop_stale_servers(run.out)
    site = None
    wheel_sha = None
    if args.bundle:
        bundle = Path(args.bundle)
        site = Path(args.site)
        man = install_bundle(bundle, site)
        wheel_sha = man["files"][f"wheels/{man['vllm_wheel']}"]["sha256"]
        run.summary["bundle"] = {"version": man["version"], "wheel": man["vllm_wheel"], "wheel_sha256": wheel_sha,
                                 "forge": man.get("forge")}
        model = Path(args.model) if args.model else bundle / "model"
    else:
        if not args.model:
            raise ForgeError("--model is needed when no --bundle is given")
        model = Path(args.model)
    python_env(site)
    args.vllm = args.vllm or f"{sys.executable} -m vllm.entrypoints.cli.main"
    run.hargs = harness_args(run.h, [*(args.server_arg or []), *shlex.split(args.server_args or "")])
    run.identity = {"bundle_wheel_sha256": wheel_sha, "server_args": run.hargs, "device": device_name()}
    if (args.triton_cache_from or args.triton_cache_pack) and not args.triton_cache:
        args.triton_cache = "/tmp/forge-triton"
    if args.triton_cache_from:
        seeded = seed_triton_cache(Path(args.triton_cache_from), Path(args.triton_cache))
        run.summary["triton_cache"] = {"seeded": seeded}
        run.step("Triton cache seeded" if "skipped" not in seeded else "Triton cache not seeded", **seeded)

    def record_versions():
        v = versions(sys.executable)
        with run.lock:
            run.summary["versions"] = v
    vt = threading.Thread(target=record_versions, daemon=True)
    vt.start()
    run.summary["profiles"] = names
    run.summary["reference"] = ref
    run.step("bundle installed" if site else "using the installed vLLM", model=str(model))
    scored: dict = {}

    def on_term(signum, frame):            # a machine's time limit: end like an interrupt, servers included
        raise KeyboardInterrupt
    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        datasets = build_datasets(run, model, args.num_prompts)
        check_resume(run, names, datasets)
        run.step("synthetic tier prompts built", prompts_per_tier=args.num_prompts)
        # import vLLM's client while the servers start (about 20 s on a GPU machine)
        run.worker_thread = threading.Thread(target=guarded, args=(run, "client", client_runner, run), daemon=True)
        run.worker_thread.start()
        live = start_all(run, model, names, site)
        if not live:
            raise ForgeError("no server came up; see summary.json server_errors and logs/")
        if live != names:
            run.summary["skipped"].append(f"profiles whose server did not come up: "
                                          f"{', '.join(n for n in names if n not in live)}")
        if run.summary.get("plumbing"):
            run.step("plumbing check: kept from an earlier invocation")
        elif not args.no_plumbing and names[0] != ref and names[0] in live and ref in live:
            prompts = [synthetic_prompt(model, n, f"plumbing{n}") for n in PLUMBING_PROMPT_TOKENS]
            pl = guarded(run, names[0], plumbing, run.servers[names[0]], run.servers[ref], prompts, run.left)
            if pl is not None:
                run.summary["plumbing"] = pl
                run.step("plumbing check", verdict=pl["verdict"])
        done = bench_rounds(run, live, model, datasets)
        run_dirs = finish_runs(run, live, done)
        scored = scores(run, run_dirs, ref)
        run.summary["scores"] = {n: {"display": r["display"], "total": r["total"], "harness": r["harness"],
                                     "tiers": {t: {"tok_s": v["tok_s"], "lift": v["lift"]} for t, v in r["tiers"].items()}}
                                 for n, r in scored.items()}
        run.step("scored", scores={n: r["display"] for n, r in scored.items()})
        measured = any(rounds for per_tier in done.values() for rounds in per_tier.values())
        if measured and e2e_decode.DEFAULT_BENCH.is_file():
            # the decode saving against the kernel benchmark's prediction, also for a run of some tiers
            try:
                e2e_decode.write(run.out, reference=ref)
                run.step("decode saving against the kernel benchmark: decode.md")
            except (ForgeError, OSError, KeyError, ValueError) as e:
                ui.warn(f"decode.md not written: {type(e).__name__}: {e}")
        if run.summary.get("fault"):
            run.step("fault check: kept from an earlier invocation")
        elif not args.no_fault and ref in live:
            if run.left() >= FAULT_NEED_S:
                fc = guarded(run, ref, fault_check, run, ref, model, datasets)
                if fc is not None:
                    run.summary["fault"] = fc
                    run.step("fault check", ok=fc["ok"])
            else:
                run.summary["skipped"].append(f"fault check: {run.left():.0f}s left, needs ~{FAULT_NEED_S:.0f}s")
    except (ForgeError, KeyboardInterrupt) as e:
        run.summary["error"] = getattr(e, "message", None) or "interrupted (SIGTERM or Ctrl-C)"
        raise
    finally:
        signal.signal(signal.SIGTERM, old_term)
        stop_all(run.servers)
        if getattr(run, "worker", None) is not None:
            run.worker.close()
        vt.join(timeout=10)
        for name, st in run.servers.items():
            run.summary.setdefault("server_facts", {})[name] = log_facts(Path(st["log"]))
        run.summary["seconds"] = round(time.monotonic() - run.t0, 1)
        run.final = (names, scored, ref)
        run.save()
        if args.triton_cache_pack and args.triton_cache and Path(args.triton_cache).is_dir():
            try:                               # after the results are saved: packing only saves time later
                packed = pack_triton_cache(Path(args.triton_cache), Path(args.triton_cache_pack))
                run.summary.setdefault("triton_cache", {})["packed"] = packed
                ui.info(f"Triton cache packed: {packed['mib']} MiB in {packed['parts']} parts under {packed['to']}")
                run.save()
            except Exception as e:
                ui.warn(f"Triton cache not packed: {type(e).__name__}: {e}")
        ui.info(f"results: {run.out}")
    return 0 if not run.summary.get("plumbing") or run.summary["plumbing"]["ok"] else 1


def register(sub) -> None:
    p = sub.add_parser("e2e-gpu", help="the end-to-end run on a GPU machine (serve, bench, plumbing, fault, score)",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=str(gpu_bundle.BUNDLE),
                   help="the bundle from `make gpu-bundle` (default build/gpu-bundle); '' uses the installed vLLM")
    p.add_argument("--site", default="/tmp/forge-e2e-site", help="where the bundle's wheels are installed")
    p.add_argument("--harness", help="harness settings (default: harness/gpu/harness.yaml)")
    p.add_argument("--model", help="model directory (default: the bundle's)")
    p.add_argument("--profiles", help="comma-separated profiles (default: harness/gpu/harness.yaml profiles)")
    p.add_argument("--reference", help="the profile scored as 60.0 (default: upstream)")
    p.add_argument("--num-prompts", type=int, default=2,
                   help="prompts per tier, one per round (default 2): requests of the contest workload "
                        "(configs/workload.yaml) evenly spaced by output length")
    p.add_argument("--fixed-output", type=int, metavar="N",
                   help="instead of the contest workload, prompts across each tier's range with N output tokens "
                        "each (the earlier runs used 1024)")
    p.add_argument("--tier-order", type=lambda s: s.split(","),
                   help="tiers in the order they run; tiers not named are not run (default: "
                        + ",".join(DEFAULT_TIER_ORDER) + ")")
    p.add_argument("--deadline-s", type=float, default=560.0,
                   help="stop starting new tier rounds so the run ends within this many seconds (default 560)")
    p.add_argument("--reserve-s", type=float, default=15.0,
                   help="seconds kept after the tier rounds for stopping the servers and writing the reports "
                        f"(default 15; {FAULT_NEED_S:.0f} s more while the fault check is still to run)")
    p.add_argument("--out", help="results folder (default: reports/e2e/<date>-<device>/)")
    p.add_argument("--pack", help="also keep a .tar.gz of the results here, rewritten after every step")
    p.add_argument("--vllm", help="how to start vLLM (default: this Python's vllm.entrypoints.cli.main)")
    p.add_argument("--client", help="command for `vllm bench serve` (default: as forge bench-all-tiers)")
    p.add_argument("--server-arg", action="append", help="one more server argument (repeatable; "
                                                            "write --server-arg=--opt for options)")
    p.add_argument("--server-args", help="more server arguments as one shell-quoted string, e.g. "
                                         "--server-args='--tensor-parallel-size 2 --disable-custom-all-reduce'")
    p.add_argument("--triton-cache", help="TRITON_CACHE_DIR shared by the servers (default /tmp/forge-triton "
                                          "when --triton-cache-from or --triton-cache-pack is given)")
    p.add_argument("--triton-cache-from", metavar="DIR",
                   help="seed the Triton cache from the parts an earlier run wrote with --triton-cache-pack "
                        "(DIR/triton-cache.json and its parts): a fresh machine then skips the kernel compiles "
                        "that run made")
    p.add_argument("--triton-cache-pack", metavar="DIR",
                   help="at the end, write the Triton cache to DIR/triton-cache.tgz.NN in parts of at most "
                        f"{TRITON_PART_MIB} MiB plus DIR/{TRITON_MANIFEST}, for --triton-cache-from on the "
                        "next machine")
    p.add_argument("--first-port", type=int, default=FIRST_PORT,
                   help=f"port of the first profile's server; the others follow (default {FIRST_PORT})")
    p.add_argument("--fault-delay-s", type=float, default=3.0, help="seconds into the request before the kill")
    p.add_argument("--client-per-tier", action="store_true",
                   help="start a fresh `vllm bench serve` per tier instead of one client process for all")
    p.add_argument("--no-plumbing", action="store_true")
    p.add_argument("--no-fault", action="store_true")
    p.set_defaults(func=cmd_e2e)
