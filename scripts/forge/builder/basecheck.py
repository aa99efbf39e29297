"""The vendor tree's build behaviour, checked on any tree (the vendor checkout, the stand-in, a
patched tree, a submission): what the platform's `setup.py bdist_wheel` needs from it.

  arch list      gfx936 is in CMakeLists.txt's HIP_SUPPORTED_ARCHS
  offline        no download reachable for HIP (offline.py); in particular no triton_kernels
  extensions     setup.py's ext_modules for HIP hold neither vllm._rocm_C nor vllm.triton_kernels
  version        0.18.1+das.dtk<digits>, written as __hcu_version__ into vllm/version.py
  rocm import    vllm/platforms/rocm.py imports no vllm._rocm_C at module level
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from .. import proc
from ..errors import ForgeError
from ..paths import rel
from . import offline, setupprobe
from .cmakelang import parse_cmake

VERSION = re.compile(r"^0\.18\.1\+das\.dtk\d+$")
NOT_BUILT = ("vllm._rocm_C", "vllm.triton_kernels")


def hip_archs(tree: Path) -> list[str]:
    for c in parse_cmake((Path(tree) / "CMakeLists.txt").read_text(errors="replace")):
        if c.name == "set" and c.args and c.args[0][0] == "HIP_SUPPORTED_ARCHS":
            return [a for v, _ in c.args[1:] for a in v.split(";") if a]
    return []


def module_level_imports(path: Path) -> list[str]:
    """Modules a file imports when it is imported (top level, and inside top-level try/if blocks)."""
    mod = ast.parse(Path(path).read_text(errors="replace"))
    found: list[str] = []

    def visit(stmts):
        for s in stmts:
            if isinstance(s, ast.Import):
                found.extend(a.name for a in s.names)
            elif isinstance(s, ast.ImportFrom) and s.module:
                found.extend([s.module] + [f"{s.module}.{a.name}" for a in s.names])
            elif isinstance(s, ast.Try):
                visit(s.body)
                visit(s.orelse)
                visit(s.finalbody)
                for h in s.handlers:
                    visit(h.body)
            elif isinstance(s, ast.If):
                visit(s.body)
                visit(s.orelse)
    visit(mod.body)
    return found


# faked by the setup.py probe (setupprobe.FAKE_TORCH): never needed from the Python that runs it
FAKED = ("torch",)


def setup_imports(tree: Path) -> list[str]:
    """The packages `tree`'s setup.py imports whatever happens (at module level, outside try), other
    than the standard library and what the probe fakes: what the Python running it must have."""
    try:
        mod = ast.parse((Path(tree) / "setup.py").read_bytes())
    except (OSError, SyntaxError, ValueError):
        return []                   # the probe itself names what is wrong with the file
    names: list[str] = []
    for s in mod.body:
        if isinstance(s, ast.Import):
            names += [a.name.split(".")[0] for a in s.names]
        elif isinstance(s, ast.ImportFrom) and s.module and not s.level:
            names.append(s.module.split(".")[0])
    return [n for n in dict.fromkeys(names) if n not in sys.stdlib_module_names and n not in FAKED]


def require_build_python(tree: Path, python: str | None = None) -> None:
    """Refuse, naming the packages, when the Python that runs the setup.py probe cannot import what
    `tree`'s setup.py imports: the probe would stop on this machine's Python, not on the tree."""
    python = python or sys.executable
    wanted = setup_imports(tree)
    if not wanted:
        return
    # in the tree, as the probe runs setup.py: a module of the tree itself is found there
    res = proc.run([python, "-c", "import importlib.util, sys\n"
                                  "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))",
                    *wanted], cwd=tree, env={"PYTHONPATH": ""}, capture=True, check=False,
                   what=f"{python} (the Python that runs setup.py)")
    missing = res.stdout.split() if res.returncode == 0 else wanted
    if missing:
        raise ForgeError(f"{python} cannot import {', '.join(missing)}, which {rel(Path(tree) / 'setup.py')} imports: "
                         "the pre-flight runs setup.py with this Python (the platform's build has its own)",
                         hint="run it with the project venv (`make venv`; make then uses .venv/bin/python), or "
                              f"install them for this Python: {python} -m pip install "
                              + " ".join(m.replace("_", "-") for m in missing))


def check(tree: Path, python: str | None = None) -> list[tuple[str, bool, str]]:
    """[(check, passed, what was found)] for `tree`; see the module's doc. A Python that cannot import
    what setup.py needs is refused first (require_build_python)."""
    tree = Path(tree)
    require_build_python(tree, python)
    out = []
    archs = hip_archs(tree)
    out.append(("arch list", "gfx936" in archs, f"HIP_SUPPORTED_ARCHS: {';'.join(archs) or '(not found)'}"))
    w = offline.check_tree(tree)
    tk = [f for f in w.files if "triton_kernels" in f]
    out.append(("offline", not w.findings and not tk and not w.unfollowed,
                "; ".join(str(f).splitlines()[0] for f in [*w.findings, *w.unfollowed]) or
                (f"{tk[0]} is reachable for HIP" if tk else f"no download reachable for HIP ({len(w.files)} CMake files)")))
    probe = setupprobe.probe_hip(tree, python)
    built = [e for e in NOT_BUILT if e in probe["ext_modules"]]
    out.append(("extensions", not built, f"ext_modules for HIP: {', '.join(probe['ext_modules'])}"
                + (f" (must not build {', '.join(built)})" if built else "")))
    v, hcu = probe["version"] or "", probe["hcu_version"]
    out.append(("version", bool(VERSION.match(v)) and hcu == v,
                f"version {v}; vllm/version.py __hcu_version__ {hcu}"))
    imports = module_level_imports(tree / "vllm" / "platforms" / "rocm.py")
    out.append(("rocm import", "vllm._rocm_C" not in imports,
                "vllm/platforms/rocm.py imports vllm._rocm_C at module level" if "vllm._rocm_C" in imports
                else "no module-level import of vllm._rocm_C"))
    if probe["network"]:
        out.append(("network", False, "setup.py tried to reach the network: " + "; ".join(probe["network"])))
    return out
