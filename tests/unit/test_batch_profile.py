"""The decode steps of several requests at once (forge.lab.batch_profile, `e2e-gpu --profile-batch`): the
trace's steps that decode exactly B requests and prefill none are the ones summed, the others counted
apart; the capture starts the B requests together and profiles only once every one has its first token;
`forge prefill-profile` renders the result. Traces are built by hand in the profiler's Chrome-trace
layout, and the server is a small in-process stand-in for vLLM's streamed completions, /start_profile,
/stop_profile, /v1/models and /metrics."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import ROOT, e2e_fake, forge_env

from forge.errors import ForgeError
from forge.lab import batch_profile as bp
from forge.lab import profiler
from forge.lab import trace_digest as td
from forge.run import serverlog

GEMV = "void fgemv::gemv_kernel<128, 1, 1, true, true>(fgemv::Params)"
ATTN = "_split_kv_decode_kernel"
GDN = "fused_recurrent_gated_delta_rule_packed_decode_kernel"
PREFILL = "_prefill_attention_kernel"


def batch_trace(path: Path, steps: list[tuple], outside: list[tuple] = ()) -> Path:
    """steps: [(cpu_ts, ctx_requests, ctx_tokens, gen_requests, gen_tokens, [(kernel, gpu_offset, dur)])], times
    in µs; each step lasts 10 µs on the CPU and launches its kernels in it; outside: [(kernel, launch_ts, gpu_ts,
    dur)] launched between steps."""
    ev, corr = [], 0
    for ts, cr, ct, gr, gt, kernels in steps:
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"execute_context_{cr}({ct})_generation_{gr}({gt})",
                   "ts": ts, "dur": 10})
        for j, (name, off, dur) in enumerate(kernels):
            corr += 1
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts + 1 + j, "dur": 1,
                       "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts + off, "dur": dur, "args": {"correlation": corr}})
    for name, lts, gts, dur in outside:
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": lts, "dur": 1,
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": gts, "dur": dur, "args": {"correlation": corr}})
    ev.append({"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_0(0)", "ts": 5, "dur": 1})
    random.Random(3).shuffle(ev)                      # the profiler's event order is not relied on
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return path


def decode(ts: int, batch: int, gdn_us: float = 4.0) -> tuple:
    """A decode step of `batch` requests at CPU time ts: a GEMV, a GDN and an attention kernel."""
    return (ts, 0, 0, batch, batch, [(GEMV, 100, 10.0), (GDN, 112, gdn_us), (ATTN, 120, 2.0)])


# the last prefill chunk of the 4th request beside 3 decoding ones (mixed), a prefill-only step, three steps at
# batch 4 (the second one's GDN kernel slower), one at batch 3 (a request ended), one more at batch 4
STEPS = [(1000, 1, 4096, 3, 3, [(PREFILL, 100, 500.0), (GEMV, 700, 30.0)]),
         (2000, 1, 4096, 0, 0, [(PREFILL, 100, 400.0)]),
         decode(3000, 4), decode(4000, 4, gdn_us=8.0), decode(5000, 4), decode(6000, 3), decode(7000, 4)]


def test_only_the_decode_steps_of_the_whole_batch_are_counted(tmp_path):
    d = td.batch_digest(batch_trace(tmp_path / "t.json.gz", STEPS, outside=[("sampling_kernel", 3500, 3600, 70.0)]), 4)
    assert [s["decode_requests"] for s in d["decode_steps"]] == [4, 4, 4, 4]
    assert d["excluded"] == {"mixed": 1, "prefill": 1, "decode_other_batch": {"3": 1}}
    assert d["steps_in_trace"] == 7
    assert d["decode_steps"][1]["kernels"] == {GEMV: [1, 10.0], GDN: [1, 8.0], ATTN: [1, 2.0]}
    assert d["decode_steps"][0]["gpu_span_ms"] == pytest.approx(0.022)
    # the GPU period only between two counted steps in a row: 3000 -> 4000 -> 5000, not 5000 -> 7000
    assert d["gpu_period_ms"] == pytest.approx([1.0, 1.0])
    assert d["outside"]["kernels"] == {"sampling_kernel": [1, 70.0]}
    s = bp.summarise({**d, "prompt_tokens": 100, "contexts_at_start": [120, 110], "contexts_at_stop": [150, 140]})
    assert s["steps"] == 4 and s["contexts"] == [110, 150]
    assert s["categories_ms"] == pytest.approx({"full attention": 0.002, "GDN": 0.005, "GEMM": 0.010, "rest": 0})
    assert s["gpu_period_ms_median"] == pytest.approx(1.0)
    assert s["outside_ms_per_step"] == pytest.approx(0.010)
    # at batch 3 the one step of 3 is the one counted; a batch no step had is refused with what was seen
    assert td.batch_digest(tmp_path / "t.json.gz", 3)["excluded"]["decode_other_batch"] == {"4": 4}
    with pytest.raises(ForgeError, match=r"no decode step of 8 requests.*1\+3, 1\+0, 0\+4"):
        td.batch_digest(tmp_path / "t.json.gz", 8)


def test_the_one_request_digest_is_unchanged_by_request_counts(tmp_path):
    """digest() (one request's prefill then decode) keeps its keys: the request counts stay in assign()."""
    d = td.digest(batch_trace(tmp_path / "t.json.gz", STEPS))
    assert [s["prefill_tokens"] for s in d["steps"]] == [4096, 4096]
    assert list(d["steps"][0]) == ["prefill_tokens", "decode_tokens", "cpu_ms", "kernels", "gpu_span_ms"]
    assert list(d["outside"]) == ["kernels", "gpu_span_ms"]
    assert len(d["decode_steps"]) == 5


# --- the capture against a stand-in server --------------------------------------------------------------

class Fake:
    """What the stand-in server saw and does: request i's first token comes FIRST_S + i * STAGGER_S after it
    arrives (prefills one after the other), then one token every TOKEN_S; at most `capacity` requests run at
    once (the others wait for a slot); /stop_profile writes `trace_steps` as the trace."""

    FIRST_S, STAGGER_S, TOKEN_S = 0.15, 0.1, 0.004

    def __init__(self, trace_dir: Path, trace_steps: list, max_model_len: int, capacity: int = 64):
        self.trace_dir, self.trace_steps, self.max_model_len = trace_dir, trace_steps, max_model_len
        self.slots = threading.Semaphore(capacity)
        self.lock = threading.Lock()
        self.arrived: list[tuple[float, str]] = []
        self.sent: dict[int, int] = {}               # request -> tokens sent
        self.first: dict[int, float] = {}
        self.active: set[int] = set()
        self.closed: set[int] = set()
        self.at_start: dict[int, int] | None = None
        self.at_stop: dict[int, int] | None = None
        self.profile_calls: list[tuple[str, float]] = []


def _handler(fake: Fake):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _json(self, obj, code=200):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._json({"data": [{"id": "m", "max_model_len": fake.max_model_len}]})
            if self.path == "/metrics":
                with fake.lock:
                    n = len(fake.active)
                data = f'# HELP x\nvllm:num_requests_running{{model_name="m"}} {float(n)}\n'.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return None
            return self._json({"error": "not found"}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            now = time.monotonic()
            if self.path in ("/start_profile", "/stop_profile"):
                with fake.lock:
                    fake.profile_calls.append((self.path, now))
                    snap = dict(fake.sent)
                if self.path == "/start_profile":
                    fake.at_start = snap
                else:
                    fake.at_stop = snap
                    fake.trace_dir.mkdir(parents=True, exist_ok=True)
                    batch_trace(fake.trace_dir / "worker.pt.trace.json.gz", fake.trace_steps)
                return self._json({})
            assert self.path == "/v1/completions" and body["stream"] and body["ignore_eos"]
            assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
            with fake.lock:
                i = len(fake.arrived)
                fake.arrived.append((now, body["prompt"]))
                fake.sent[i] = 0
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            n_in = len(body["prompt"].split())
            with fake.slots:
                with fake.lock:
                    fake.active.add(i)
                time.sleep(fake.FIRST_S + i * fake.STAGGER_S)
                try:
                    for k in range(body["max_tokens"]):
                        done = k + 1 == body["max_tokens"]
                        chunk = {"choices": [{"index": 0, "text": " w", "finish_reason": "length" if done else None}],
                                 "usage": {"prompt_tokens": n_in, "completion_tokens": k + 1}}
                        data = f"data: {json.dumps(chunk)}\n\n".encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                        with fake.lock:
                            fake.sent[i] = k + 1
                            fake.first.setdefault(i, time.monotonic())
                        time.sleep(fake.TOKEN_S)
                    data = b"data: [DONE]\n\n"
                    self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
                    self.wfile.flush()
                except OSError:                     # the client closed the stream: the request is aborted
                    with fake.lock:
                        fake.closed.add(i)
                finally:
                    with fake.lock:
                        fake.active.discard(i)
            return None
    return H


@pytest.fixture
def served(tmp_path, monkeypatch):
    """start(trace_steps, max_model_len, capacity) -> (fake, run) with the server up on a free port."""
    monkeypatch.setattr(bp.synth, "synthetic_prompt", lambda model, n, seed: f"{seed} " + "w " * n)
    servers = []

    def start(trace_steps, max_model_len, capacity=64):
        out = tmp_path / "run"
        fake = Fake(profiler.trace_dir(out, "contest"), trace_steps, max_model_len, capacity)
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
        st = {"host": "127.0.0.1", "port": srv.server_address[1], "served_model_name": "m"}
        return fake, SimpleNamespace(servers={"contest": st}, out=out)
    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_the_requests_start_together_and_the_profile_waits_for_every_first_token(served):
    steps_asked = 8
    fake, run = served(STEPS, max_model_len=100 + bp.PROMPT_SLACK + steps_asked + bp.HEADROOM + 500)
    dig = bp.capture(run, "contest", Path("model"), 100, steps_asked, 4, wait_s=60)
    # four fresh prompts, sent at once: all had arrived before the first one's first token
    assert len(fake.arrived) == 4 and len({p for _, p in fake.arrived}) == 4
    assert max(t for t, _ in fake.arrived) < min(fake.first.values())
    # the profile started once every request had its first token, and stopped after 8 tokens more of each
    (start, t_start), (stop, t_stop) = fake.profile_calls
    assert (start, stop) == ("/start_profile", "/stop_profile")
    assert t_start > max(fake.first.values())
    assert all(fake.at_start[i] >= 1 for i in range(4))
    assert all(fake.at_stop[i] - fake.at_start[i] >= steps_asked for i in range(4))
    # then every request was closed (aborted on the server), none ran to its end
    assert fake.closed == {0, 1, 2, 3} and not fake.active and dig["server_idle_after_close"] is True
    # the record: the batch-4 decode steps of the trace, the contexts the requests had, the steps asked
    saved = json.loads((run.out / "batch-profile" / "contest-b4.json").read_text())
    assert saved["batch"] == 4 and len(saved["decode_steps"]) == 4 and saved["decode_steps_asked"] == steps_asked
    assert saved["excluded"] == {"mixed": 1, "prefill": 1, "decode_other_batch": {"3": 1}}
    n_in = 101                                       # the stand-in counts the seed word and the 100 words
    assert [r["prompt_tokens"] for r in saved["requests"]] == [n_in] * 4
    assert all(c - n_in >= 1 for c in saved["contexts_at_start"])
    assert all(b - a >= steps_asked for a, b in zip(saved["contexts_at_start"], saved["contexts_at_stop"]))
    # the requests that started first had decoded more tokens when the profile started
    assert saved["requests"][0]["tokens_at_start"] > saved["requests"][3]["tokens_at_start"]
    assert dig["headline"]["batch"] == 4 and dig["headline"]["decode_steps"] == 4


def test_a_server_that_does_not_hold_the_batch_at_once_is_refused(served):
    """With room for 2 requests at a time, the 3rd gets its first token only once one of the first two ended:
    the batch never decoded together, and no profile is taken."""
    fake, run = served(STEPS, max_model_len=100 + bp.PROMPT_SLACK + 8 + bp.HEADROOM, capacity=2)
    with pytest.raises(ForgeError, match="ended before the last of the 3 had its first token"):
        bp.capture(run, "contest", Path("model"), 100, 8, 3, wait_s=60)
    assert fake.profile_calls == []
    assert not (run.out / "batch-profile").exists()


def test_a_prompt_too_long_for_the_output_the_profile_needs_is_refused_before_any_request(served):
    fake, run = served(STEPS, max_model_len=100 + bp.PROMPT_SLACK + 8 + bp.HEADROOM - 1)
    with pytest.raises(ForgeError, match=r"--profile-prefill 100 --profile-decode 8: the server's max-model-len"):
        bp.capture(run, "contest", Path("model"), 100, 8, 4, wait_s=60)
    assert fake.arrived == []


# vLLM 0.18.1's start-up lines (vllm/v1/core/kv_cache_utils.py), as the GPU harness's 5 GiB servers logged them
KV_LOG = ("(EngineCore_DP0 pid=812) INFO 12-03 10:01:02 [kv_cache_utils.py:1318] GPU KV cache size: 20,384 tokens\n"
          "(EngineCore_DP0 pid=812) INFO 12-03 10:01:02 [kv_cache_utils.py:1324] Maximum concurrency for 32,768 "
          "tokens per request: 2.31x\n")


@pytest.mark.parametrize("argv,batch,match", [
    (["vllm", "serve", "m", "--max-num-seqs", "128", "--max-num-seqs", "4"], 5, r"at most 4 requests at once"),
    (["vllm", "serve", "m", "--max-num-seqs=3"], 4, r"at most 3 requests at once"),
    (["vllm", "serve", "m", "--max-num-seqs", "2", "--data-parallel-size", "2"], 5, r"2 data-parallel ranks"),
])
def test_a_batch_over_the_servers_max_num_seqs_is_refused_before_any_request(served, argv, batch, match):
    """vLLM never runs more than --max-num-seqs requests at once: the rest would wait until one that ran alone
    ends (its whole output), minutes of the GPU machine, and the profile fails then."""
    fake, run = served(STEPS, max_model_len=100 + bp.PROMPT_SLACK + 8 + bp.HEADROOM + 500)
    run.servers["contest"]["server_args"] = argv
    with pytest.raises(ForgeError, match=match) as e:
        bp.capture(run, "contest", Path("model"), 100, 8, batch, wait_s=60)
    assert "--profile-batch" in e.value.hint
    assert fake.arrived == [] and fake.profile_calls == []


def test_a_batch_over_the_servers_kv_cache_is_refused_before_any_request(served, tmp_path):
    """The harness's 5 GiB KV cache holds 2.31 requests of 32,768 tokens (75,694 tokens of a hybrid model's
    requests): four of 20,000 tokens never decode together."""
    fake, run = served(STEPS, max_model_len=32768)
    log = tmp_path / "server.log"
    log.write_text("INFO starting\n" + KV_LOG)
    run.servers["contest"].update(log=str(log), server_args=["vllm", "serve", "m", "--max-num-seqs", "128"])
    with pytest.raises(ForgeError, match=r"holds about 75,694 tokens.*4 requests of 20000 \+ 64 tokens need 80,256"):
        bp.capture(run, "contest", Path("model"), 20000, 64, 4, wait_s=60)
    assert fake.arrived == [] and fake.profile_calls == []


def test_the_kv_capacity_is_each_ranks_last_report_summed():
    assert serverlog.kv_capacity_tokens(KV_LOG) == 75694
    two = KV_LOG + KV_LOG.replace("DP0 pid=812", "DP1 pid=813") + KV_LOG.replace("2.31x", "2.00x")   # DP0 restarted
    assert serverlog.kv_capacity_tokens(two) == 65536 + 75694
    assert serverlog.kv_capacity_tokens("\x1b[1;36m" + KV_LOG.replace("(EngineCore_DP0 pid=812) ", "")) == 75694
    assert serverlog.kv_capacity_tokens("GPU KV cache size: 20,384 tokens\n") is None


def test_a_batch_the_server_holds_is_not_refused(served, tmp_path):
    """The checks refuse only what the server said it cannot run: within its KV cache (here 2 x 32,768 tokens at
    2.00x, 4 requests of 16,000 + 64) and its --max-num-seqs the batch is profiled."""
    fake, run = served(STEPS, max_model_len=16000 + bp.PROMPT_SLACK + 8 + bp.HEADROOM + 500)
    log = tmp_path / "server.log"
    log.write_text(KV_LOG.replace("2.31x", "2.00x"))
    run.servers["contest"].update(log=str(log), server_args=["vllm", "serve", "m", "--max-num-seqs", "4"])
    bp.refuse_unfit(run.servers["contest"], 16000, 64, 4)             # 64,256 tokens, within 65,536 and 4 seqs
    dig = bp.capture(run, "contest", Path("model"), 100, 8, 4, wait_s=60)
    assert len(fake.arrived) == 4 and dig["headline"]["batch"] == 4


# --- the document -----------------------------------------------------------------------------------------

def _record(run: Path, tmp_path: Path) -> None:
    d = td.batch_digest(batch_trace(tmp_path / "t.json.gz", STEPS), 4)
    d.update(profile="contest", prompt_tokens=20000, decode_steps_asked=4, contexts_at_start=[20050, 20010, 20030, 20020],
             contexts_at_stop=[20055, 20015, 20035, 20025])
    (run / "batch-profile").mkdir(parents=True)
    (run / "batch-profile" / "contest-b4.json").write_text(json.dumps(d))


def test_the_document_says_the_batch_the_contexts_and_the_steps_counted(tmp_path):
    run = tmp_path / "run"
    _record(run, tmp_path)
    out = tmp_path / "doc"
    r = subprocess.run([sys.executable, "-m", "forge", "prefill-profile", str(run), "--out", str(out)], cwd=ROOT,
                       env=forge_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "prefill-profile.json").read_text())
    assert doc["profiles"] == {}
    b = doc["batch_profiles"]["contest-b4"]
    assert b["batch"] == 4 and b["steps"] == 4 and b["contexts"] == [20010, 20055]
    assert b["top_kernels"][0]["name"] == GEMV and b["top_kernels"][0]["us"] == pytest.approx(10.0)
    md = (out / "prefill-profile.md").read_text()
    assert md.startswith("# Where a decode step's time goes at a batch")
    assert "| contest | 4 | 20010-20055 | 4 (4) | 1 / 1 / 1 | 1.000 | 0.022 |" in md
    assert "### contest-b4: largest kernels per decode step at batch 4" in md
    assert "One fresh prompt per profile" not in md and not (out / "prefill-profile.png").exists()


def test_e2e_gpu_profiles_the_batch_after_the_tiers(tmp_path):
    """The whole run against the fake server (tests/support/fakeserver.py: streamed completions, and a trace of
    three decode steps at the batch it was streaming at /start_profile plus one mixed step): the batch profile
    replaces the one-request profile, and `forge prefill-profile` renders it."""
    r, _, out = e2e_fake(tmp_path, "--profiles", "contest", "--tier-order", "4-8K", "--no-plumbing", "--no-fault",
                         "--profile-prefill", "200", "--profile-decode", "4", "--profile-batch", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "server_errors" not in json.loads((out / "summary.json").read_text())
    d = json.loads((out / "batch-profile" / "contest-b2.json").read_text())
    assert d["batch"] == 2 and len(d["decode_steps"]) == 3 and d["excluded"]["mixed"] == 1
    assert all(q["tokens_at_start"] >= 1 and q["tokens_at_stop"] - q["tokens_at_start"] >= 4 for q in d["requests"])
    assert not (out / "prefill-profile").exists()
    r = subprocess.run([sys.executable, "-m", "forge", "prefill-profile", str(out), "--out", str(tmp_path / "doc")],
                       cwd=ROOT, env=forge_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| contest | 2 |" in (tmp_path / "doc" / "prefill-profile.md").read_text()
