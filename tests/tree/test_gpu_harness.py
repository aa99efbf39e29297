"""The GPU end-to-end harness against the patched tree and vLLM's own code (rehearsal venv):
the harness patches apply on top of the product series and the overlay only adds files; the plain-torch
stand-ins for `vllm._C` compute what vLLM's own native implementations compute (float64 references,
fresh random inputs, partial rotary as in Qwen3.5); and a whole `forge e2e-gpu` run with vLLM's real
benchmark client against two fake servers, fault check included."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from forge.builder import wheel  # noqa: E402
from forge.lab import gpu_bundle  # noqa: E402

STANDIN = ROOT / "harness" / "gpu" / "overlay" / "vllm" / "_C.py"


def test_harness_applies_on_the_patched_tree_and_only_adds_files(patched_tree, tmp_path):
    # the bundle is built inside this repository's build/: the source copy sits in someone's work tree
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    src = tmp_path / "build" / "src"
    wheel.clean_copy(patched_tree, src)
    applied = gpu_bundle.apply_harness(src)
    assert [a for a in applied if a.endswith(".patch")] == [p.name for p in gpu_bundle.harness_patches()]
    assert "vllm/_C.py" in applied
    for f in ("vllm/vllm_flash_attn/__init__.py", "vllm/v1/structured_output/backend_xgrammar.py",
              "vllm/v1/structured_output/backend_guidance.py", "vllm/entrypoints/openai/chat_completion/serving.py"):
        compile((src / f).read_text(), f, "exec")
    assert "raise ImportError" not in (src / "vllm/vllm_flash_attn/__init__.py").read_text()
    for f in ("backend_xgrammar.py", "backend_guidance.py"):
        assert "from __future__ import annotations" in (src / "vllm/v1/structured_output" / f).read_text()
    assert "except ImportError:  # GPU harness" in \
        (src / "vllm/entrypoints/openai/chat_completion/serving.py").read_text()
    # a second application must refuse (the overlay file exists now), naming the file
    from forge.errors import ForgeError
    with pytest.raises(ForgeError):
        gpu_bundle.apply_harness(src)


def test_harness_patches_never_touch_forbidden_paths():
    import fnmatch
    import re

    from forge.contest import rules as contest
    c = contest.load_contest()
    for p in gpu_bundle.harness_patches():
        files = re.findall(r"^diff --git a/(\S+) b/", p.read_text(), flags=re.M)
        assert files, p.name
        for f in files:
            for rule in c["forbidden_paths"]:
                assert not fnmatch.fnmatch(f, rule["glob"]), (p.name, f, rule)


STANDIN_CHECK = r'''
import importlib.util, json, torch
spec = importlib.util.spec_from_file_location("standin_C", {standin!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.layernorm import RMSNorm
torch.manual_seed(1234)
out = {{}}
# rotary: Qwen3.5 full-attention layers rotate 64 of 256 dims (partial_rotary_factor 0.25)
for is_neox in (True, False):
    for head, rot, nq, nk, T in ((256, 64, 24, 4, 37), (128, 128, 3, 1, 5)):
        pos = torch.randint(0, 4000, (T,))
        cache = torch.randn(4096, rot, dtype=torch.float64)
        q = torch.randn(T, nq * head, dtype=torch.float64)
        k = torch.randn(T, nk * head, dtype=torch.float64)
        rq, rk = RotaryEmbedding.forward_static(pos, q.clone(), k.clone(), head, rot, cache, is_neox)
        q2, k2 = q.clone(), k.clone()
        torch.ops._C.rotary_embedding(pos, q2, k2, head, cache, is_neox)
        out[f"rope_{{is_neox}}_{{head}}"] = max((q2 - rq).abs().max().item(), (k2 - rk).abs().max().item())
        out[f"rope_moved_{{is_neox}}_{{head}}"] = (q2 - q).abs().max().item()
# rms_norm / fused_add_rms_norm against vLLM's RMSNorm.forward_static
w = torch.randn(5120, dtype=torch.float64)
x = torch.randn(7, 5120, dtype=torch.float64); res = torch.randn(7, 5120, dtype=torch.float64)
ref = RMSNorm.forward_static(x.clone(), 1e-6, 5120, torch.float64, w)
y = torch.full_like(x, float("nan"))
torch.ops._C.rms_norm(y, x, w, 1e-6)
out["rms"] = (y - ref).abs().max().item()
ref_o, ref_r = RMSNorm.forward_static(x.clone(), 1e-6, 5120, torch.float64, w, res.clone())
x2, r2 = x.clone(), res.clone()
torch.ops._C.fused_add_rms_norm(x2, r2, w, 1e-6)
out["fused_out"] = (x2 - ref_o).abs().max().item()
out["fused_res"] = (r2 - ref_r).abs().max().item()
# silu_and_mul: SiluAndMul.forward_native
from vllm.model_executor.layers.activation import SiluAndMul
a = torch.randn(5, 2 * 17408, dtype=torch.float64)
o = torch.full((5, 17408), float("nan"), dtype=torch.float64)
torch.ops._C.silu_and_mul(o, a)
out["silu"] = (o - SiluAndMul.forward_native(a)).abs().max().item()
# bf16, the dtype of real runs: against the same native code on the same bf16 inputs
xb = torch.randn(7, 5120).bfloat16(); wb = torch.randn(5120).bfloat16(); rb = torch.randn(7, 5120).bfloat16()
yb = torch.full_like(xb, float("nan"))
torch.ops._C.rms_norm(yb, xb, wb, 1e-6)
out["bf16_rms"] = (yb.float() - RMSNorm.forward_static(xb.clone(), 1e-6, 5120, torch.bfloat16, wb).float()).abs().max().item()
ro, rr = RMSNorm.forward_static(xb.clone(), 1e-6, 5120, torch.bfloat16, wb, rb.clone())
xb2, rb2 = xb.clone(), rb.clone()
torch.ops._C.fused_add_rms_norm(xb2, rb2, wb, 1e-6)
out["bf16_fused_out"] = (xb2.float() - ro.float()).abs().max().item()
out["bf16_fused_res"] = (rb2.float() - rr.float()).abs().max().item()
pos = torch.randint(0, 4000, (9,)); cache = torch.randn(4096, 64).bfloat16()
qb = torch.randn(9, 24 * 256).bfloat16(); kb = torch.randn(9, 4 * 256).bfloat16()
rq, rk = RotaryEmbedding.forward_static(pos, qb.clone(), kb.clone(), 256, 64, cache, True)
q3, k3 = qb.clone(), kb.clone()
torch.ops._C.rotary_embedding(pos, q3, k3, 256, cache, True)
out["bf16_rope"] = max((q3.float() - rq.float()).abs().max().item(), (k3.float() - rk.float()).abs().max().item())
ab = torch.randn(5, 2 * 17408).bfloat16(); ob = torch.empty(5, 17408).bfloat16()
torch.ops._C.silu_and_mul(ob, ab)
out["bf16_silu"] = (ob.float() - SiluAndMul.forward_native(ab).float()).abs().max().item()
# repetition penalties against vLLM's torch path
from vllm._custom_ops import apply_repetition_penalties_torch
lg = torch.randn(3, 1000); pm = torch.rand(3, 1000) < 0.1; om = torch.rand(3, 1000) < 0.1
pen = torch.tensor([1.0, 1.3, 2.0])
ref_l = lg.clone(); apply_repetition_penalties_torch(ref_l, pm, om, pen)
got_l = lg.clone(); torch.ops._C.apply_repetition_penalties_(got_l, pm, om, pen)
out["rep_pen"] = (got_l - ref_l).abs().max().item()
out["rep_pen_moved"] = (got_l - lg).abs().max().item()
print(json.dumps(out))
'''


def test_standin_ops_match_vllms_native_implementations(run_in_vllm):
    r = run_in_vllm(STANDIN_CHECK.format(standin=str(STANDIN)))
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for k, v in out.items():
        if "moved" in k:
            assert v > 0.1, (k, v)             # the op did change the tensors in place
        elif k.startswith("bf16_"):
            assert v == 0.0, (k, v)            # same bf16 arithmetic as vLLM's native code
        else:
            assert v < 1e-12, (k, v)


SILU_ONE_PASS = r'''
import importlib.util, json, torch
spec = importlib.util.spec_from_file_location("standin_C", {standin!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
from vllm.model_executor.layers.activation import SiluAndMul
torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
out = {{}}
# ragged widths (not a multiple of the kernel's 1024-column block), rows with a stride of their own (a
# slice of a wider buffer, as a GEMM output view can be), bf16 / fp16 / fp32
for dt in (torch.bfloat16, torch.float16, torch.float32):
    for rows, d, pad in ((3, 1100, 0), (5, 17408 // 8, 24), (1, 7, 0)):
        buf = (torch.randn(rows, 2 * d + pad) * 4).to(dt)
        x = buf[:, :2 * d]
        o = torch.full((rows, d), float("nan"), dtype=dt)
        ran = m._one_pass(o, x)
        ref = SiluAndMul.forward_native(x)
        # float64 reference of the same function: the kernel's error is the dtype's rounding
        x64 = x.double(); ref64 = torch.nn.functional.silu(x64[:, :d]) * x64[:, d:]
        key = f"{{str(dt)[6:]}}_{{rows}}x{{d}}"
        out[key] = {{"ran": ran, "nan": int(o.isnan().sum()),
                    "rel64": ((o.double() - ref64).norm() / ref64.norm()).item(),
                    "max_rel_native": ((o.double() - ref.double()).abs() / (ref.double().abs() + 1e-30)).max().item()}}
# what the kernel does not take falls back: a CPU call outside the interpreter is the caller's concern;
# here a mismatched output dtype and a non-unit column stride are refused
x = torch.randn(4, 64).bfloat16()
out["refused_dtype"] = m._one_pass(torch.empty(4, 32), x)
out["refused_stride"] = m._one_pass(torch.empty(4, 64).bfloat16()[:, ::2], x)
print(json.dumps(out))
'''


def test_standin_silu_and_mul_is_one_pass_with_the_native_arithmetic(run_in_vllm):
    """The stand-in's one-kernel silu_and_mul (what a GPU machine runs), here in Triton's interpreter:
    every element written, against float64 within two roundings to the dtype, and in fp32 within a few
    units in the last place of vLLM's native forward (exp may differ in the last bits). The interpreter truncates a downcast
    to bf16/fp16 where a GPU rounds to nearest, so their match with the native forward is checked on the
    GPU machine, not here."""
    r = run_in_vllm(SILU_ONE_PASS.format(standin=str(STANDIN)), env={"TRITON_INTERPRET": "1"})
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for k, v in out.items():
        if k.startswith("refused"):
            assert v is False, k
            continue
        assert v["ran"] is True and v["nan"] == 0, (k, v)
        if k.startswith("float32"):
            assert v["rel64"] < 1e-6 and v["max_rel_native"] < 1e-6, (k, v)
        else:
            assert v["rel64"] < (2 ** -6 if k.startswith("bfloat16") else 2 ** -9), (k, v)


# --- the default compilation config: the ops its passes name ----------------------------------------

def binding_schemas(tree: Path) -> dict[str, str]:
    """Every schema vLLM's csrc/torch_bindings.cpp defines (`ops.def("...")`, adjacent C++ string
    literals joined as the compiler joins them), by op name (overloads as name.overload)."""
    import re
    text = (tree / "csrc" / "torch_bindings.cpp").read_text()
    out = {}
    for m in re.finditer(r'\b\w+\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)', text):
        schema = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
        out[schema.split("(", 1)[0]] = schema
    return out


@pytest.fixture(scope="module")
def harness_src(patched_tree, tmp_path_factory):
    """The bundle's vLLM as source: the product tree with the harness patches and overlay applied."""
    tmp = tmp_path_factory.mktemp("harness-src")
    subprocess.run(["git", "init", "-q", str(tmp)], check=True)
    src = tmp / "build" / "src"
    wheel.clean_copy(patched_tree, src)
    gpu_bundle.apply_harness(src)
    return src


SCHEMAS = r'''
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("standin_C", {standin!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
cpp = json.loads({cpp!r})
out = {{"schema_only": list(m.SCHEMA_ONLY), "ops": {{}}}}
for s in torch._C._jit_get_all_schemas():          # what torch now knows of the _C namespace
    if not s.name.startswith("_C::"):
        continue
    full = s.name[4:] + (f".{{s.overload_name}}" if s.overload_name else "")
    theirs = str(torch._C.parse_schema("_C::" + cpp[full])) if full in cpp else None
    out["ops"][full] = [str(s), theirs]
print(json.dumps(out))
'''

# the stand-in's deliberate differences from vLLM's bindings: weak_ref_tensor returns a view of its
# input, which torch requires the schema to declare as an alias
ALIAS_NOT_WEAK_REF = {"weak_ref_tensor"}


def test_standin_schemas_are_vllms_own(run_in_vllm, patched_tree):
    """Every op the stand-in defines has the schema vLLM 0.18.1's torch_bindings.cpp gives it (read
    from the pinned source here, so a mismatch shows), the schema-only ops of the compilation passes
    included."""
    cpp = binding_schemas(patched_tree)
    r = run_in_vllm(SCHEMAS.format(standin=str(STANDIN), cpp=json.dumps(cpp)))
    out = json.loads(r.stdout.strip().splitlines()[-1])
    want = {"static_scaled_fp8_quant", "dynamic_scaled_fp8_quant", "dynamic_per_token_scaled_fp8_quant",
            "per_token_group_fp8_quant", "scaled_fp4_quant", "scaled_fp4_quant.out", "silu_and_mul_quant",
            "silu_and_mul_nvfp4_quant", "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant",
            "rms_norm_dynamic_per_token_quant", "rms_norm_per_block_quant", "fused_qk_norm_rope", "cutlass_scaled_mm"}
    assert {s.split("(", 1)[0] for s in out["schema_only"]} == want
    assert want <= set(out["ops"])
    for name, (mine, theirs) in out["ops"].items():
        assert theirs is not None, f"{name}: not an op of vLLM's torch_bindings.cpp"
        if name in ALIAS_NOT_WEAK_REF:
            assert mine.replace("(a)", "") == theirs, (name, mine, theirs)
        else:
            assert mine == theirs, (name, mine, theirs)


PASSES = r'''
import importlib, importlib.util, json, sys
sys.path.insert(0, {src!r})
spec = importlib.util.spec_from_file_location("vllm._C", {standin!r})
m = importlib.util.module_from_spec(spec); sys.modules["vllm._C"] = m; spec.loader.exec_module(m)
import vllm
assert vllm.__file__.startswith({src!r}), vllm.__file__
# as on the GPU machine: the pass manager imports the CUDA passes there
from vllm.platforms import current_platform
type(current_platform).is_cuda = lambda self: True
type(current_platform).is_cuda_alike = lambda self: True
out = {{}}
for mod in {modules!r}:
    try:
        importlib.import_module(mod)
        out[mod] = "ok"
    except Exception as e:
        out[mod] = f"{{type(e).__name__}}: {{e}}"
print(json.dumps(out))
'''

PASS_MODULES = ["vllm.compilation.passes.pass_manager"] + [
    f"vllm.compilation.passes.fusion.{m}" for m in (
        "act_quant_fusion", "allreduce_rms_fusion", "attn_quant_fusion", "collective_fusion", "matcher_utils",
        "qk_norm_rope_fusion", "rms_quant_fusion", "rope_kvcache_fusion", "sequence_parallelism")] + [
    "vllm.compilation.passes.utility.fix_functionalization"]


def test_the_compilation_passes_import_with_the_standin(run_in_vllm, harness_src, tmp_path):
    """vLLM's default compilation config (the organizers' command) has the pass manager import the
    fusion passes, whose modules look up their ops at import: with the bundle's vLLM (harness patches
    and stand-in) they import on the CPU as on an NVIDIA GPU; the same stand-in without its schema-only
    ops fails exactly there."""
    code = PASSES.format(src=str(harness_src), standin=str(harness_src / "vllm" / "_C.py"), modules=PASS_MODULES)
    out = json.loads(run_in_vllm(code).stdout.strip().splitlines()[-1])
    assert out == {m: "ok" for m in PASS_MODULES}, out
    # without the schemas (the stand-in as it was before them): the fusion modules stop at a missing op
    text = STANDIN.read_text()
    start, end = text.index("SCHEMA_ONLY = ("), text.index("# --- the FLA/GDN")
    bare = tmp_path / "_C.py"
    bare.write_text(text[:start] + text[end:])
    code = PASSES.format(src=str(harness_src), standin=str(bare), modules=PASS_MODULES)
    out = json.loads(run_in_vllm(code).stdout.strip().splitlines()[-1])
    failed = {m: e for m, e in out.items() if e != "ok"}
    assert "vllm.compilation.passes.pass_manager" in failed, out
    assert all("has no attribute" in e and "'_C'" in e for e in failed.values()), failed


PARSE = r'''
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.loads(sys.argv[1]):
    ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    validate_parsed_serve_args(ns)
    ns.model = ns.model_tag
    ea = AsyncEngineArgs.from_cli_args(ns)
    out.append({"ns": {k: repr(v) for k, v in vars(ns).items()},
                "compilation_default": repr(ea.compilation_config) == repr(type(ea.compilation_config)())})
print(json.dumps(out))
'''


def test_vllm_reads_the_harness_command_as_the_organizers_but_for_the_listed_changes(vllm_python):
    """vLLM's own `vllm serve` parser on the organizers' command and on each harness server's: every
    setting is the same (the compilation config vLLM's default) except those the run lists as
    differences."""
    import types

    from forge.contest import profiles
    from forge.contest import rules as contest
    from forge.lab import servers, tiers
    c = contest.load_contest()
    h = gpu_bundle.harness_config()
    names = h["profiles"]
    run = types.SimpleNamespace(
        args=types.SimpleNamespace(first_port=8001, profile_prefill=None, stack_every=None), names=names, contest=c, h=h,
        hargs=tiers.harness_args(h, []), triton_cache=None, profiles={n: profiles.load_profile(n, c) for n in names},
        vllm_cmd="vllm", child_env={}, identity={}, out=Path("/nonexistent"), rnd=None, serve_tier=None, capacity={})
    model = "/models/Qwen3.5-27B"
    theirs = profiles.render(profiles.load_profile("upstream", c), model, c)["argv"][2:]
    launches = [servers.plan(run, Path(model), n)["launch"][2:] for n in names]
    r = subprocess.run([str(vllm_python), "-c", PARSE, json.dumps([theirs, *launches])], capture_output=True,
                       text=True, env={"VLLM_LOGGING_LEVEL": "ERROR", "PATH": "/usr/bin:/bin"}, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    base, *mine = json.loads(r.stdout.strip().splitlines()[-1])
    assert base["compilation_default"] and all(m["compilation_default"] for m in mine)
    diffs = tiers.differences(h, [], ports={n: servers.port_of(run, n) for n in names})
    for name, m in zip(names, mine):
        listed = {d["args"][0] for d in diffs if d["side"] == "server"
                  and (d["args"][0] != "--port" or d["why"].startswith(f"{name}'s server"))}
        listed |= set(run.profiles[name]["options"])          # the profile's own, as in a contest run
        want = {o.lstrip("-").replace("-", "_") for o in listed}
        changed = {k for k in base["ns"] if m["ns"].get(k) != base["ns"][k]}
        assert changed == want, (name, changed ^ want)
        assert m["ns"]["gpu_memory_utilization"] == repr(h["side_by_side"]["gpu_memory_utilization"])
        assert m["ns"]["load_format"] == "'dummy'" and m["ns"]["max_model_len"] == "32768"


@pytest.fixture(scope="module")
def client(vllm_python):
    r = subprocess.run([str(vllm_python), "-c", "import pandas, vllm.benchmarks.serve"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("the rehearsal venv cannot run `vllm bench serve`: " + r.stderr.strip().splitlines()[-1])
    return f"{vllm_python} -m vllm.entrypoints.cli.main"


def test_e2e_with_the_real_client_and_a_server_killed_mid_tier(tmp_path, client):
    """Two fake servers, vLLM's own `vllm bench serve`, one prompt per tier, then the fault check
    kills the reference server while its reply streams: that tier's request is recorded failed,
    the tiers after it find no server, and the score zeroes them."""
    from helpers import forge_env, free_port_pair
    p = free_port_pair()
    model = tmp_path / "model"
    gpu_bundle.write_model_dir(gpu_bundle.harness_config(), model)
    # replies of 1024 tokens at 4 ms: 4 s of streaming, so the kill lands mid-reply
    env = forge_env(tmp_path, FAKE_TOKEN_MS="4")
    fake = f"{sys.executable} {ROOT / 'tests' / 'support' / 'fakeserver.py'}"
    r = subprocess.run([sys.executable, "-m", "forge", "e2e-gpu", "--bundle", "", "--model", str(model),
                        "--vllm", fake, "--client", client, "--first-port", str(p), "--out", str(tmp_path / "out"),
                        "--num-prompts", "1", "--fault-delay-s", "1", "--fixed-output", "1024",
                        "--start-guess-s", "0",                  # a fake server starts in about a second
                        "--stack-every", "0.5"],                 # and its stacks are sampled
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["scores"].get("upstream", {}).get("display") == "60.0", json.dumps(
        {k: s.get(k) for k in ("scores", "score_note", "skipped", "server_errors", "steps")}, indent=1)[-6000:]
    for prof in ("contest", "upstream"):
        for t in ("4-8K", "8-16K", "16-32K"):
            res = json.loads((tmp_path / "out" / "runs" / prof / f"{t}.json").read_text())
            assert res["completed"] == 1 and res["failed"] == 0 and res["total_output_tokens"] == 1024
    # every tier ran in the one long-lived client process (vLLM's own parser and main)
    log = (tmp_path / "out" / "runs" / "upstream" / "8-16K.client.log").read_text()
    assert "forge bench worker" in log.splitlines()[0] and "Serving Benchmark Result" in log
    # with the organizers' two warm-ups (the tier's first prompt) before the measured prompt, and no
    # ready check: three chat requests per (tier, profile) reached the contest server
    assert "Warming up with 2 requests" in log and "Skipping endpoint ready check" in log
    served = (tmp_path / "out" / "runs" / "contest" / "server.log").read_text()
    assert served.count("POST /v1/chat/completions") == 3 * 3
    f = s["fault"]
    assert f["ok"], f
    assert f["failed"] == {"4-8K": 1, "8-16K": 1, "16-32K": 1}
    assert f["statuses"]["8-16K"] == "server-down" and f["statuses"]["16-32K"] == "server-down"
    assert all(v["contribution"] == 0 for v in f["score"].values())
    # the fault run's report is the same kind `forge score` writes, failed tiers shown as such
    rec = json.loads((tmp_path / "out" / "runs" / "fault-upstream" / "score.json").read_text())
    assert all(t["contribution"] == 0 for t in rec["tiers"].values()) and "output_drift" in rec
    assert "# Proxy score (harness run)" in (tmp_path / "out" / "runs" / "fault-upstream" / "score.md").read_text()
    assert rec["harness"] is True
    assert "as intended" in (tmp_path / "out" / "summary.md").read_text()
    # --stack-every: each server process sampled where its main thread was, the digest in the run and its summary
    stacks = json.loads((tmp_path / "out" / "stacks.json").read_text())
    for prof in ("contest", "upstream"):
        assert any(p["samples"] >= 2 and "fakeserver.py" in p["argv"] and p["top"] for p in stacks[prof]), stacks[prof]
    assert any(d["args"][0] == "FORGE_STACK_EVERY=0.5" for d in s["differences"])
    assert "## Where the servers' processes were" in (tmp_path / "out" / "summary.md").read_text()


def test_gpu_bundle_builds_with_the_harness_in_its_wheel(patched_tree, tmp_path):
    """`forge gpu-bundle` end to end (pip fetches the pinned wheels through its own configuration):
    the wheel carries the stand-in and every harness patch, the manifest verifies, the size fits."""
    import zipfile
    out = tmp_path / "bundle"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts")}
    r = subprocess.run([sys.executable, "-m", "forge", "gpu-bundle", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    man = gpu_bundle.verify_bundle(out)
    assert ".gpuharness." in man["version"] and not man["version"].endswith(".cpu")
    z = zipfile.ZipFile(out / "wheels" / man["vllm_wheel"])
    assert "vllm/_C.py" in z.namelist()
    assert b"from __future__ import annotations  # GPU harness" in \
        z.read("vllm/v1/structured_output/backend_guidance.py")
    assert b"raise ImportError" not in z.read("vllm/vllm_flash_attn/__init__.py")
    assert b"except ImportError:  # GPU harness" in z.read("vllm/entrypoints/openai/chat_completion/serving.py")
    h = gpu_bundle.harness_config()
    wheels = [n for n in man["files"] if n.startswith("wheels/")]
    assert len(wheels) == len(h["wheels"]) + 1
    assert man["total_bytes"] < h["max_bundle_mib"] * 2**20
    assert json.loads((out / "model" / "config.json").read_text())["text_config"]["vocab_size"] == 248320
    # beside the bundle: the checkout's commit and its tracked files, for the GPU machine's records
    src = json.loads((tmp_path / "source-manifest.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert src["commit"] == head.stdout.strip() and "patches/series" in src["files"]
