"""What the submission's GEMV route takes on the card, in words (English and Chinese) for its documents:
the built-in ROCm table as the patch series defines it, and the tuned tables the kernel overlay installs
with the submission (a table whose validators name the card's arch sets the route there)."""

from __future__ import annotations

import re
from pathlib import Path

from .. import config, paths, records
from ..builder import tree
from ..errors import ForgeError
from ..recipe.patchfile import read_series

MMA = "mma"     # a tuned table's GEMV entry that names the skinny GEMM (kernels/forge_tuned)

# Qwen3.5-27B's bf16 linear layers by weight shape (N x K), as the GEMV tables name them
SHAPE_NAMES = {"14336x5120": "qkv+gate", "16384x5120": "in_proj_qkvz", "34816x5120": "gate_up",
               "5120x17408": "down", "5120x6144": "o_proj/out_proj", "96x5120": "in_proj_ba",
               "248320x5120": "LM head"}
EN_COUNT = "no one two three four five six seven eight nine ten".split()
ZH_COUNT = "零一两三四五六七八九十"


def en_count(n: int) -> str:
    return EN_COUNT[n] if n < len(EN_COUNT) else str(n)


def zh_count(n: int) -> str:
    """A count in Chinese: a numeral up to ten, else the number set off by spaces ("和 12 个")."""
    return ZH_COUNT[n] if n < len(ZH_COUNT) else f" {n} "


def rocm_gemv_route(patches_dir: Path = paths.PATCHES) -> dict[str, dict[str, list[int]]]:
    """The built-in ROCm GEMV table as the series leaves it: {"plain"|"fused": {"NxK": [token counts]}}
    from the last definition of FORGE_GEMV_ROCM / FORGE_GEMV_FUSED_ROCM the patches add."""
    route: dict[str, dict[str, list[int]]] = {}
    switch = False                  # a series without the GEMV switch routes nothing to our GEMV
    head = re.compile(r"^\+(FORGE_GEMV(_FUSED)?_ROCM)\s*(?::[^=]*)?=\s*\{")
    entry = re.compile(r"^\+\s*\((\d+),\s*(\d+)\):\s*frozenset\(\{([\d,\s]*)\}\)")
    for name in read_series(patches_dir):
        cur = None
        for line in (patches_dir / name).read_text(errors="replace").splitlines():
            switch = switch or (line.startswith("+") and "VLLM_FORGE_GEMV" in line)
            m = head.match(line)
            if m:
                cur = "fused" if m.group(2) else "plain"
                route[cur] = {}
            elif cur and (e := entry.match(line)):
                route[cur][f"{e.group(1)}x{e.group(2)}"] = sorted(int(x) for x in e.group(3).split(",") if x.strip())
            elif cur and line.startswith("+}"):
                cur = None
    if "plain" not in route and not switch:
        return {"plain": {}, "fused": {}}
    if "plain" not in route:
        raise ForgeError("patches/series: no patch defines the built-in ROCm GEMV table (FORGE_GEMV_ROCM)",
                         hint="the documents describe the ROCm route from it: update rocm_gemv_route() "
                              "in scripts/forge/ship/card_route.py to the series' new name")
    route.setdefault("fused", {})
    return route


def _tokens(counts: list[int]) -> str:
    words = [str(c) for c in counts]
    text = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
    return f"{text} token{'s' if counts != [1] else ''}"


def _tokens_zh(counts: list[int]) -> str:
    return "、".join(map(str, counts)) + " 个 token"


def describe_route(route: dict[str, dict[str, list[int]]]) -> tuple[str, str]:
    """(English, Chinese) phrase of what a GEMV table routes to our kernel ("three one-token shapes to
    our GEMV: ..."), each shape with the layer of Qwen3.5-27B it is."""
    plain, fused = route["plain"], route.get("fused") or {}
    named = [f"{SHAPE_NAMES.get(s, 'the layer')} {s}" for s in plain]
    counts = {tuple(v) for v in plain.values()}
    if not plain:
        en, zh = "no shape to our GEMV", "没有形状走我们的 GEMV"
    elif len(counts) == 1:
        rows = list(next(iter(counts)))
        en = (f"{en_count(len(plain))} {'one-token ' if rows == [1] else ''}shape{'s' if len(plain) != 1 else ''} to "
              f"our GEMV: " + ", ".join(named[:-1]) + (" and " if len(named) > 1 else "") + named[-1]
              + f", at {_tokens(rows)}")
        zh = f"{zh_count(len(plain))}个形状在 {_tokens_zh(rows)} 时走我们的 GEMV：" + "、".join(named)
    else:
        en = f"{en_count(len(plain))} shapes to our GEMV: " + "; ".join(
            f"{n} at {_tokens(plain[s])}" for n, s in zip(named, plain))
        zh = f"{zh_count(len(plain))}个形状走我们的 GEMV：" + "；".join(
            f"{n}（{_tokens_zh(plain[s])}）" for n, s in zip(named, plain))
    if fused:
        en += "; and the MLP's gate_up + SiLU-and-mul to our fused kernel, at " + "; ".join(
            f"{_tokens(v)} ({SHAPE_NAMES.get(s, 'the layer')} {s})" for s, v in fused.items())
        zh += "；MLP 的 gate_up + SiLU 融合在 " + "；".join(
            f"{_tokens_zh(v)} 时（{SHAPE_NAMES.get(s, 'the layer')} {s}）" for s, v in fused.items()) + "走我们的融合内核"
    return en, zh


def describe_mma(mma: dict[str, dict[str, list[int]]]) -> tuple[str, str]:
    """(English, Chinese) phrase of the pairs a table routes to the Triton skinny GEMM on the matrix units
    (its "mma" entries), or ("", "") for none."""
    items = [(f"{SHAPE_NAMES.get(s, 'the layer')} {s}" + (" (fused with SiLU-and-mul)" if k == "fused" else ""),
              f"{SHAPE_NAMES.get(s, 'the layer')} {s}" + ("（与 SiLU 融合）" if k == "fused" else ""), v)
             for k in ("plain", "fused") for s, v in (mma.get(k) or {}).items()]
    if not items:
        return "", ""
    return ("; and to our skinny GEMM on the matrix units: " + "; ".join(f"{n} at {_tokens(v)}" for n, _, v in items),
            "；并让 " + "；".join(f"{z}（{_tokens_zh(v)}）" for _, z, v in items) + "走我们在矩阵单元上的 skinny GEMM")


def split_route(gemv: dict) -> tuple[dict, dict]:
    """A table's gemv section as ({"plain"|"fused": {"NxK": token counts of our GEMV}}, the same of the
    skinny GEMM, its "mma" entries); a shape with no token count of one kernel is left out of its map."""
    route: dict = {"plain": {}, "fused": {}}
    mma: dict = {"plain": {}, "fused": {}}
    for k in ("plain", "fused"):
        for s, rows in (gemv.get(k) or {}).items():
            for m, launch in rows.items():
                (mma if launch == MMA else route)[k].setdefault(s, []).append(int(m))
    for part in (route, mma):
        for shapes in part.values():
            for v in shapes.values():
                v.sort()
    return route, mma


def shipped_tables() -> list[dict]:
    """The tuned tables the kernel overlay installs with the submission: [{name, dst, validators, route, mma}]:
    route the token counts per shape of our GEMV, mma those of the skinny GEMM (the table's "mma" entries)."""
    out = []
    for e in tree.overlay_entries():
        if not e["src"].endswith(".json"):
            continue
        p = paths.ROOT / e["src"]
        try:
            t = records.read_json(p)
            g = t.get("gemv") or {}
            route, mma = split_route(g)
        except (ValueError, TypeError, AttributeError) as err:
            raise ForgeError(f"{e['src']}: not a tuned table the documents can read ({err})",
                             hint="check the table with `forge calibrate`, or remove it") from None
        out.append({"name": p.name, "dst": e["dst"].rsplit("/", 1)[0] + "/", "validators": t.get("validators") or {},
                    "route": route, "mma": mma})
    return out


def gemv_on_card() -> tuple[str, str]:
    """(English, Chinese): what VLLM_FORGE_GEMV=auto routes on the card, and which tuned tables could
    change that."""
    archs = config.build()["rocm_arch"]
    arch = " / ".join(archs)
    b_en, b_zh = describe_route(rocm_gemv_route())
    tables = shipped_tables()
    mine = [t for t in tables if str(t["validators"].get("arch", "")).split(":")[0] in archs]
    en = (f"On the card (ROCm, {arch}) `VLLM_FORGE_GEMV=auto` routes {b_en}; every other shape and token count "
          "keeps vLLM's own GEMM path (rocBLAS or its skinny kernels).")
    zh = f"在 DCU（ROCm，{arch}）上，`VLLM_FORGE_GEMV=auto` 让{b_zh}；其余形状和 token 数仍走 vLLM 自己的 GEMM。"
    if not tables:
        return (en + " No tuned table is installed with the submission, so this built-in route is the one taken.",
                zh + "提交中没有安装调优表，因此使用上述内置路由。")
    if not mine:
        made = "; ".join(f"`{t['name']}` for {t['validators'].get('device_name', '?')} ({t['validators'].get('arch', '?')}, "
                         f"{t['validators'].get('compute_units', '?')} compute units)" for t in tables)
        return (en + f" The tuned tables installed with the submission ({tables[0]['dst']}) are made for other "
                f"devices: {made}. None names {arch}, so on the card this built-in route is the one taken (the "
                "server log names the table taken, or says that none matched).",
                zh + f"随提交安装的调优表（{tables[0]['dst']}）都是为其他设备做的（"
                + "、".join(f"{t['name']}：{t['validators'].get('device_name', '?')}" for t in tables)
                + f"），没有一张针对 {arch}，因此在 DCU 上使用上述内置路由。")
    t = mine[0]
    t_en, t_zh = describe_route(t["route"])
    m_en, m_zh = describe_mma(t.get("mma") or {})
    t_en, t_zh = t_en + m_en, t_zh + m_zh
    return (f"On the card (ROCm, {arch}) the tuned table `{t['name']}` installed with the submission ({t['dst']}) "
            f"names the device ({', '.join(f'{k} {v}' for k, v in t['validators'].items())}); where every validator "
            f"matches the running card, `VLLM_FORGE_GEMV=auto` routes {t_en}. Where it does not match, the built-in "
            f"route applies: {b_en}. The server log names the table taken.",
            f"在 DCU（ROCm，{arch}）上，随提交安装的调优表 `{t['name']}`（{t['dst']}）针对该设备；若其校验项与所用的卡"
            f"一致，`VLLM_FORGE_GEMV=auto` 让{t_zh}。若不一致，则使用内置路由：{b_zh}。")
