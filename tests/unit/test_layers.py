"""The package layout is the architecture: no import cycles, and no layer imports one above
it (docs/architecture.md, "Where the code is"). Reads the source; imports nothing."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "orchestrator"

# Lowest first. A module may import its own layer and the layers below it.
LAYERS = [
    {"orchestrator", "orchestrator.defaults", "orchestrator.errors", "orchestrator.phase_table", "orchestrator.plugins",
     "orchestrator.rewards", "orchestrator.environments", "orchestrator.terminal"},
    {"orchestrator.node"},
    {"orchestrator.config", "orchestrator.train.settings"},  # the trainer's settings: sections of the run's config
    {"orchestrator.protocol"},
    {"orchestrator.coordination"},
    {"orchestrator.data", "orchestrator.checkpoints", "orchestrator.preflight"},
    {"orchestrator.runtime"},
    {"orchestrator.workloads", "orchestrator.engine", "orchestrator.train", "orchestrator.demo", "orchestrator.agents"},
    {"orchestrator.ops", "orchestrator.tracking"},
    {"orchestrator.cli", "orchestrator.__main__"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The orchestrator modules ``path`` imports, anywhere in it (lazy imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "orchestrator":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                out.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "orchestrator")
    return out


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if module in layer:
            return i
    for i, layer in enumerate(LAYERS):
        if any(module.startswith(prefix + ".") for prefix in layer if prefix != "orchestrator"):
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and to docs/architecture.md")


def test_every_module_belongs_to_a_layer_and_imports_none_above_it():
    modules = _modules()
    upward = []
    for module, path in sorted(modules.items()):
        for target in sorted(_imports(path, modules)):
            if _layer(target) > _layer(module):
                upward.append(f"{module} imports {target}")
    assert not upward, "lower layers must not import upper ones:\n" + "\n".join(upward)


def test_there_is_no_import_cycle():
    modules = _modules()
    graph = {m: {t for t in _imports(p, modules) if t in modules and t != m} for m, p in modules.items()}
    done, on_path, cycles = set(), [], []

    def visit(module: str) -> None:
        on_path.append(module)
        for target in sorted(graph[module]):
            if target in on_path:
                cycles.append(" -> ".join(on_path[on_path.index(target):] + [target]))
            elif target not in done:
                visit(target)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


COORDINATION = {"orchestrator.coordination", *(f"orchestrator.coordination.{m}" for m in (
    "coordinator", "attendance", "monitor", "heartbeat", "startup", "wakeup", "executor", "barriers"))}
"""The rank's coordination: its threads, executors and rules. Phases and workloads are told
what they need of it through ``RunView``."""


def test_phases_and_workloads_see_the_run_through_its_view_never_the_coordinator():
    """runtime/phases/ and workloads/ get ``PhaseContext.run`` (a ``RunView``); a name or an
    attribute ``coordinator`` there, or an import of the coordination's modules, would be a
    reach past it."""
    reach = []
    for folder in (ROOT / "runtime" / "phases", ROOT / "workloads"):
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
                imported = node.module if isinstance(node, ast.ImportFrom) else None
                if name == "coordinator" or (imported or "").startswith("orchestrator.coordination"):
                    reach.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not reach, "phases and workloads reach into the coordinator:\n" + "\n".join(reach)


def test_the_trainer_does_not_import_the_run_config():
    """train/ is its own program: it reads its request (train/request.py), whose settings the
    run's config derives from (train/settings.py), never the run's config module."""
    modules = _modules()
    reach = [f"{m} imports {t}" for m, p in sorted(modules.items()) if m.startswith("orchestrator.train")
             for t in sorted(_imports(p, modules)) if t == "orchestrator.config" or t.startswith("orchestrator.config.")]
    assert not reach, "\n".join(reach)


def test_the_engine_loads_models_without_the_demo():
    modules = _modules()
    reach = [f"{m} imports {t}" for m, p in sorted(modules.items()) if m.startswith("orchestrator.engine")
             for t in sorted(_imports(p, modules)) if t.startswith("orchestrator.demo")]
    assert not reach, "\n".join(reach)


def test_at_most_eight_modules_sit_flat_in_the_package():
    flat = sorted(p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(flat) <= 8, f"{len(flat)} modules flat in orchestrator/: {', '.join(flat)}"


def test_the_users_seams_live_in_one_package():
    """Rewards, environments and the module:name loader are orchestrator/plugins/; the two
    names users write (orchestrator.rewards:math, orchestrator.environments.Step) only re-export."""
    for face in ("rewards", "environments"):
        tree = ast.parse((ROOT / f"{face}.py").read_text())
        defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
        assert not defined, f"orchestrator/{face}.py defines {defined}: its code belongs in orchestrator/plugins/{face}.py"
        assert all(n.module == f"orchestrator.plugins.{face}" for n in tree.body if isinstance(n, ast.ImportFrom))
    # cli/__init__.py imports its own commands by name on first use (orchestrator.cli.COMMANDS): no user code
    loaders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
               if "importlib.import_module" in p.read_text() and p != ROOT / "cli" / "__init__.py"]
    assert all(p.startswith("plugins/") for p in loaders), f"module:name is loaded outside orchestrator/plugins/: {loaders}"


def test_the_protocol_holds_formats_and_rules_and_no_thread_or_executor():
    """protocol/ is the file formats and the pure rules; the threads that watch and beat and
    the executors that read files, call a rule and act are orchestrator/coordination/."""
    threads = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "protocol").glob("*.py"))
               if "threading.Thread(" in p.read_text()]
    assert not threads, f"threads in protocol/: {threads}"
    modules = _modules()
    reach = [f"{m} imports {t}" for m, p in sorted(modules.items()) if m.startswith("orchestrator.protocol")
             for t in sorted(_imports(p, modules)) if t.startswith("orchestrator.coordination")]
    assert not reach, "\n".join(reach)
    placing = [f"{path.relative_to(ROOT)}:{node.lineno}" for folder in ("protocol", "coordination") for path in sorted((ROOT / folder).glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef) and node.name == "place"]
    assert not placing, f"GPU placement is node/placement.py's: {placing}"


def test_the_coordinator_stays_small():
    lines = len((ROOT / "coordination" / "coordinator.py").read_text().splitlines())
    assert lines <= 400, f"coordination/coordinator.py has {lines} lines: give a concern its own module"

