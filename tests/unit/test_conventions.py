"""The tool's written conventions (docs/architecture.md), checked on the source itself: the stage
packages only import in the allowed direction, every subprocess starts in forge.proc, and no module
grows past the size where it should become two."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "scripts" / "forge"
MODULES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Absolute names of the forge modules and packages `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    pkg = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "forge"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "forge":
                continue
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def test_the_import_parser_sees_relative_imports():
    """The checks below rest on this: a relative import of lab from a sibling stage is seen."""
    e2e = imported(PKG / "lab" / "e2e.py")
    assert "forge.run.serve" in e2e and "forge.lab.gpu_bundle" in e2e and "forge.errors" in e2e


@pytest.mark.parametrize("stage", ["builder", "run"])
def test_build_and_run_never_import_the_lab(stage):
    offenders = {}
    for path in MODULES:
        name = module_name(path)
        if name.startswith(f"forge.{stage}"):
            bad = sorted(m for m in imported(path) if m == "forge.lab" or m.startswith("forge.lab."))
            if bad:
                offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders, f"forge.{stage} must not import forge.lab: {offenders}"


def test_the_core_imports_no_lab():
    core = [p for p in MODULES if p.parent == PKG]
    assert core, "no core modules found"
    for path in core:
        assert not any(m.startswith("forge.lab") for m in imported(path)), path


def import_graph() -> dict[str, set[str]]:
    """forge module -> the forge modules it imports (anywhere in it: top level, inside a function, or
    for type checking only), a package's import of one of its modules counted as that module's."""
    names = {module_name(p) for p in MODULES}
    return {module_name(p): {m for m in imported(p) if m in names} - {module_name(p)} for p in MODULES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    group.append(x)
                    if x == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_tool():
    """No two modules of scripts/forge import each other, directly or round a ring, not even inside a
    function or for type checking only: a shared piece lives in the module both can import."""
    assert not circles(import_graph()), "import circles (move the shared piece where both can import it)"


SPAWNERS = {("subprocess", "run"), ("subprocess", "Popen"), ("subprocess", "call"), ("subprocess", "check_call"),
            ("subprocess", "check_output"), ("os", "system"), ("os", "popen"), ("os", "execv"), ("os", "execvp"),
            ("os", "execvpe"), ("os", "execve"), ("os", "spawnv"), ("os", "spawnvp"), ("os", "posix_spawn")}


def spawns(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and (node.value.id, node.attr) in SPAWNERS:
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
        if isinstance(node, ast.ImportFrom) and node.module in ("subprocess", "os") and \
                any((node.module, a.name) in SPAWNERS for a in node.names):
            found.append(f"from {node.module} import ... (line {node.lineno})")
    return found


def test_the_spawn_finder_finds_a_spawn():
    assert spawns(PKG / "proc.py"), "forge.proc starts processes; the finder must see it"


def test_every_subprocess_starts_in_proc():
    offenders = {str(p.relative_to(ROOT)): spawns(p) for p in MODULES if p != PKG / "proc.py" and spawns(p)}
    assert not offenders, f"start processes through forge.proc (proc.run, proc.start, ...): {offenders}"


def test_no_module_is_two_modules():
    long = {str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES * 1.05}
    assert not long, f"modules over ~{MAX_LINES} lines (split them by concern): {long}"


def test_every_package_says_what_it_owns():
    for init in [PKG / "__init__.py", *(PKG / s / "__init__.py" for s in ("builder", "run", "lab"))]:
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 8, f"{init.relative_to(ROOT)} needs a docstring saying what it owns"


def test_help_lists_every_verb_once_grouped_by_stage_in_pipeline_order():
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    from forge import cli
    text = cli.build_parser().format_help()
    heads = [text.index(h + ":") for h in (cli.HEADINGS[s] for s in (*cli.STAGES, ""))]
    assert heads == sorted(heads), "stages appear in pipeline order"
    expected = {"builder": {"fetch", "tree", "wheel", "image", "patches-check"},
                "run": {"serve", "bench-all-tiers", "score", "sweep", "report"},
                "lab": {"e2e-gpu", "gpu-bundle"}}
    for i, stage in enumerate(cli.STAGES):
        block = text[heads[i]:heads[i + 1]]
        verbs = [line.split()[0] for line in block.splitlines()[1:] if line.startswith("  ") and line.split()]
        assert verbs == sorted(verbs), f"{stage} verbs sorted"
        assert expected[stage] <= set(verbs), f"{stage} holds {expected[stage] - set(verbs)}"
    for verb in ("serve", "tree", "e2e-gpu"):
        assert sum(1 for line in text.splitlines() if line.split()[:1] == [verb]) == 1
