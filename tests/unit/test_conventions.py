"""The tool's written conventions (docs/architecture.md), checked on the source itself: the layers
import in one direction only (a lower one never imports a higher one), imports sit at the top of a
module, every subprocess starts in forge.proc, and no module grows past the size where it should
become two."""

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "scripts" / "forge"
MODULES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Absolute names of the forge modules and packages `path` imports (relative imports resolved)."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py", str(path))


def imports_in(source: str, name: str, is_package: bool = False, filename: str = "<source>") -> set[str]:
    """The forge names that `source`, the module `name`, imports anywhere: at the top, inside a
    function, or for type checking only."""
    tree = ast.parse(source, filename=filename)
    here = name.split(".")
    pkg = here if is_package else here[:-1]
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


# The layers of scripts/forge, lowest first. A module imports modules of its own layer and of the
# layers below it, never of one above (docs/architecture.md draws the order). The core is the modules
# at the top of forge/; the verbs that drive the stages from there (the CLI, the project's environment
# and test loop) sit above everything.
LAYERS = (
    "core",                     # forge.config, proc, paths, errors, ui, options, hashing, tunedtable
    ("contest", "recipe"),      # what both stages read: the contest's rules and profiles; the series, provenance
    "builder",                  # the build stage
    "model",                    # models of the card and the workload (capacity, the finals' time model)
    "run",                      # the run stage (it serves and reports what was built)
    "ship",                     # the submission, the export and their documents: made from both stages
    "lab",                      # the GPU stand-in harness
    "commands",                 # forge.cli, forge.__main__ and the core's verbs that drive the stages
)
COMMANDS = {"cli", "__main__", "devenv", "testrun"}
PACKAGES = {p.parent.name for p in PKG.glob("*/__init__.py")}


def layer(name: str) -> int:
    """The layer of a forge module, package or imported name (forge.contest.rules.load_contest: contest's)."""
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if top in COMMANDS:
        return LAYERS.index("commands")
    if top in PACKAGES:
        return next(i for i, l in enumerate(LAYERS) if top == l or top in l)
    return LAYERS.index("core")


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """module -> the names it imports from a layer above its own."""
    up = {m: sorted(n for n in names if layer(n) > layer(m)) for m, names in graph.items()}
    return {m: names for m, names in up.items() if names}


def test_every_package_has_its_layer():
    assert PACKAGES, "no packages found"
    for pkg in PACKAGES:
        assert sum(pkg == l or pkg in l for l in LAYERS) == 1, f"forge.{pkg}: name its layer in LAYERS (and the doc)"


def test_the_layer_check_sees_an_import_upward():
    """The check below rests on this: an import from a higher layer is seen, inside a function too,
    and imports downward or within a layer are not."""
    graph = {"forge.builder.patches": imports_in("def f():\n    from ..run.contest import load_contest\n",
                                                 "forge.builder.patches"),
             "forge.run.report": imports_in("from ..builder import tree\nfrom . import runs\n", "forge.run.report"),
             "forge.recipe.patchfile": imports_in("from .. import paths\nfrom ..contest import rules\n",
                                                  "forge.recipe.patchfile"),
             "forge.paths": imports_in("def f():\n    from . import cli\n", "forge.paths"),
             "forge.cli": imports_in("from .lab import e2e\n", "forge.cli")}
    assert upward_imports(graph) == {"forge.builder.patches": ["forge.run.contest", "forge.run.contest.load_contest"],
                                     "forge.paths": ["forge.cli"]}


def test_a_lower_layer_never_imports_a_higher_one():
    """core -> contest, recipe -> builder -> model -> run -> ship -> lab -> the commands: an import goes down or
    stays in its layer, counting imports inside functions and for type checking only."""
    graph = {module_name(p): imported(p) for p in MODULES}
    up = upward_imports(graph)
    assert not up, f"imports from a higher layer (move the shared piece down a layer): {up}"


def inner_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements inside a function or method (nested ones once)."""
    seen: dict[int, ast.stmt] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    seen[id(node)] = node
    return sorted(seen.values(), key=lambda n: n.lineno)


def misplaced_imports(source: str) -> list[str]:
    """The imports inside functions that belong at the module's top: a forge or standard-library
    module, or a third-party one without a comment saying why it waits (on its line, or on a comment
    line directly above its group of imports)."""
    tree = ast.parse(source)
    comments = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    inner = inner_imports(tree)
    import_lines = {i for n in inner for i in range(n.lineno, n.end_lineno + 1)}
    lines = source.splitlines()
    found = []
    for node in inner:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        top = names[0].split(".")[0]
        if getattr(node, "level", 0) or top == "forge" or top in sys.stdlib_module_names:
            found.append(f"line {node.lineno}: {names[0] or '.'} (move it to the top of the module)")
            continue
        above = node.lineno - 1
        while above >= 1 and above not in comments and above in import_lines:
            above -= 1
        if node.lineno not in comments and not (above >= 1 and above in comments
                                                and lines[above - 1].lstrip().startswith("#")):
            found.append(f"line {node.lineno}: {names[0]} (say why it is imported here, in a comment)")
    return found


def test_the_import_place_check_sees_a_misplaced_import():
    assert misplaced_imports("def f():\n    import json\n") == ["line 2: json (move it to the top of the module)"]
    assert misplaced_imports("def f():\n    from . import proc\n")[0].startswith("line 2: . (move")
    assert misplaced_imports("def f():\n    import torch\n") == \
        ["line 2: torch (say why it is imported here, in a comment)"]
    assert misplaced_imports("import json\ndef f():\n    import torch  # heavy: only this verb\n"
                             "def g():\n    # heavy: only this verb\n    import torch\n    import torch.cuda\n") == []


def test_imports_sit_at_the_top_of_the_module():
    """Inside a function only a heavy or optional third-party package (torch, vLLM, matplotlib, ...),
    with the reason beside it; the tool's own modules and the standard library at the top."""
    offenders = {str(p.relative_to(ROOT)): bad for p in MODULES if (bad := misplaced_imports(p.read_text()))}
    assert not offenders, f"imports inside functions: {offenders}"


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
    for init in [PKG / "__init__.py", *(PKG / s / "__init__.py" for s in sorted(PACKAGES))]:
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
