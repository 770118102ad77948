"""The package's shape (README, How it is built): modules import downwards only (a registry's imports by name
included), collectives live in the step's modules (parallel/: mesh.py, step.py, strategies/), strategy names are
compared only in the strategy registry and layouts told apart only in jdp/parallel/, model families are asked, never branched on, outside jdp/models/, fault injection
lives in faults.py, no function outgrows a screen, and the command line starts without JAX."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JDP = ROOT / "jdp"
# "trainer", "parallel.strategies" (its __init__), "parallel.strategies.ddp": every module but jdp/__init__.py
MODULES = {
    ".".join(p.relative_to(JDP).with_suffix("").parts).removesuffix(".__init__"): p
    for p in JDP.rglob("*.py")
    if p != JDP / "__init__.py"
}
STEP_MODULES = {"parallel.mesh", "parallel.step", "parallel.sync.diloco"} | {
    name for name in MODULES if name.startswith("parallel.strategies")
}


def inside(package: str, name: str) -> bool:
    """Whether module `name` ("parallel.strategies.ddp") is `package` ("parallel") or in it."""
    return name == package or name.startswith(package + ".")


def imports(path: Path) -> set[str]:
    """The jdp modules `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jdp"):
            package = node.module.removeprefix("jdp").removeprefix(".")
            prefix = package + "." if package else ""  # from jdp import parallel; from jdp.parallel.strategies import ddp
            submodules = {prefix + a.name for a in node.names if prefix + a.name in MODULES}
            found |= submodules
            if package and len(submodules) < len(node.names):  # names from the module itself
                found.add(package)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("jdp.") for a in node.names if a.name.startswith("jdp.")}
    return found & set(MODULES)


def lines_matching(pattern: re.Pattern, modules, also=lambda line: True) -> list[str]:
    """`module:line: text` of every line of `modules` (names) that `pattern` finds (and `also` accepts)."""
    return [
        f"{name}:{i}: {line.strip()}"
        for name in modules
        for i, line in enumerate(MODULES[name].read_text().splitlines(), 1)
        if pattern.search(line) and also(line)
    ]


def imported_by_name(path: Path) -> set[str]:
    """The jdp modules `path` names in a string ("jdp.models.gpt"): what a registry imports on first use."""
    named = {f"jdp.{name}": name for name in MODULES}
    if "importlib" not in path.read_text():
        return set()  # a name for another process (`python -m jdp.cli`), not an import
    return {named[node.value] for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in named}  # fmt: skip


def test_no_module_imports_one_that_imports_it_back():
    """Registries import by name (importlib), so those names are imports too: a family or strategy module that
    imported its registry back would be a cycle."""
    graph = {name: (imports(path) | imported_by_name(path)) - {name} for name, path in MODULES.items()}
    cycles = []

    def visit(name: str, stack: list[str]) -> None:
        for dep in graph[name]:
            if dep in stack:
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in done:
                visit(dep, [*stack, dep])
        done.add(name)

    done: set[str] = set()
    for name in graph:
        visit(name, [name])
    assert not cycles, f"import cycles among jdp modules: {sorted(set(cycles))}"
    assert {"models.gpt", "models.llama"} <= imported_by_name(MODULES["models"])  # the check sees the registry's


def test_modules_import_only_modules_above_them_in_the_readme_table():
    section = (ROOT / "README.md").read_text().split("## How it is built", 1)[1].split("\n## ", 1)[0]
    rank = {}
    for i, cell in enumerate(re.findall(r"^\| (`[^|]+`) \|", section, re.M)):
        for name in re.findall(r"`([\w/]+)\.py`", cell):
            rank[name.replace("/", ".").removesuffix(".__init__")] = i
    assert set(rank) == set(MODULES), f"README's module table and jdp/ differ: {set(rank) ^ set(MODULES)}"
    upward = [
        f"{name} imports {dep}"
        for name, path in MODULES.items()
        for dep in imports(path) - {name}
        if rank[dep] >= rank[name]
    ]
    assert not upward, f"imports of a module not above the importer in README's table: {upward}"


def test_collectives_and_axis_names_live_in_the_step_modules_only():
    """parallel/mesh.py owns the mesh and its axis, parallel/step.py and the strategies the collectives of the step
    (parallelize.py only dispatches to them); a communication hook (comm_hooks.py) reduces one bucket with
    collectives over the axis it is handed (GradBucket.axis), and places nothing itself."""
    collectives = ("psum", "psum_scatter", "pmean", "all_gather", "pcast", "pvary")
    placement = ("shard_map", "PartitionSpec", "NamedSharding", "Mesh", "AXIS")
    allowed = {"parallel": {"AXIS"}}  # jdp.parallel loads mesh.py's axis name for library users

    def words(name: str) -> tuple[str, ...]:
        return placement + ('"data"', "'data'") if name == "parallel.comm_hooks" else collectives + placement

    offenders = {
        name: [w for w in words(name) if w not in allowed.get(name, ())
               and re.search(rf"(?<![\w.]){re.escape(w)}(?!\w)", path.read_text())]
        for name, path in MODULES.items()
        if name not in STEP_MODULES
    }  # fmt: skip
    assert not {k: v for k, v in offenders.items() if v}, offenders
    hooks = MODULES["parallel.comm_hooks"].read_text()
    assert "bucket.axis" in hooks and "pmean" in hooks  # the rule above checks something


def test_strategy_names_are_compared_only_in_the_strategy_registry():
    """Everything jdp asks about a strategy is an attribute of its registry entry (parallel/strategies/__init__.py) or a
    function of its module: adding a strategy is one module and one entry, never an `if strategy == ...` elsewhere."""
    names = "|".join(("ddp", "zero1", "dp", "fsdp", "hsdp"))
    compared = re.compile(rf"""(==|!=|\bin\b)\s*[(\[{{]?\s*["']({names})["']|["']({names})["']\s*(==|!=|\bin\b)""")
    offenders = lines_matching(compared, [name for name in MODULES if not inside("parallel.strategies", name)])
    assert offenders == [], offenders
    assert compared.search('if strategy == "zero1":') and compared.search("elif 'dp' in names")  # it finds them


def test_model_families_are_asked_never_branched_on_outside_their_package():
    """Everything jdp asks about a model family is a function of its module (jdp/models/): no comparison of
    model.arch, no isinstance on a family's model class, no import of one, outside jdp/models/."""
    families = "GPT|Llama"
    branch = re.compile(
        rf"""\barch\s*(==|!=|\bin\b)|(==|!=|\bin\b)\s*[(\[{{]?\s*["'](gpt|llama)["']|isinstance\([^)]*\b({families})\b"""
        rf"|from jdp\.models\.(gpt|llama) import|\b(gpt|llama)\.({families})\b"
    )
    offenders = lines_matching(branch, [name for name in MODULES if not name.startswith("models")])
    assert offenders == [], offenders
    for bad in ('if m.arch == "llama":', "isinstance(model, GPT)", "isinstance(model, GPT | Llama)",
                'untied = cfg.model.arch in ("llama",)', "from jdp.models.llama import rope"):  # fmt: skip
        assert branch.search(bad), bad  # it finds them


def test_the_trainer_asks_its_data_never_probes_it():
    """The trainer, the loop and its callbacks call what dataset.Source says a run's data does; only
    dataset.source_for looks at what a user handed in (and gives a loader of their own Source's defaults)."""
    probe = re.compile(r"\b(hasattr|getattr)\((run\.)?(data|eval_data|self\.data|run\.eval_data)\b")
    offenders = lines_matching(probe, ("trainer", "loop", "callbacks", "lm"))
    assert offenders == [], offenders
    assert probe.search('getattr(data, "stats", None)') and probe.search('hasattr(run.eval_data, "eval_sets")')


def test_jax_private_api_is_used_in_one_module():
    """JAX's private API moves between versions: every use is in jdp/jax_private.py, which says which it was
    checked on, so a new JAX breaks one module, by name."""
    users = sorted(name for name, path in MODULES.items() if "jax._src" in path.read_text())
    assert users == ["jax_private"], users


def test_a_layout_is_asked_never_told_apart_outside_the_parallel_package():
    """A strategy's optimizer layout (step.OptLayout, zero1's Slices, fsdp's Rows) views, places, checks and counts
    itself; outside jdp/parallel/ nothing asks which kind it holds (only what it can do: splits_parameters,
    reads_into) and checkpoint.py reads its own record."""
    told_apart = re.compile(r"\.rows\b(?!\()|\.of_record\(|\brows=(True|False)|\b(Slices|Rows)\(|\bOptLayout\(\w")
    outside = [name for name in MODULES if not inside("parallel", name)]
    offenders = lines_matching(told_apart, outside, also=lambda line: "layout" in line.lower())
    assert offenders == [], offenders
    for bad in ("if layout.rows:", "OptLayout(n, rows=True)", "saved = OptLayout.of_record(record)", "layout = Rows(4)"):
        assert told_apart.search(bad), bad  # it finds them


def test_the_checkpoint_format_has_one_owner():
    """checkpoint.py lays out and reads a checkpoint's record (make_record, saved_layout, saved_comm,
    saved_data_state) and the stream positions beside it (Checkpoints.save, .position); nothing else indexes the
    record's keys or writes beside a checkpoint."""
    keys = "|".join(("optimizer_layout", "comm", "data", "config", "param_shapes", "checksums", "comm_checksums"))
    reads = re.compile(rf"""record(\.get\(|\[)\s*["']({keys})["']|\.data_state\(""")
    offenders = lines_matching(reads, [name for name in MODULES if name not in ("checkpoint", "rundir")])
    assert offenders == [], offenders
    for bad in ('record.get("comm")', "record['optimizer_layout']", "run_dir.data_state(step, rank)"):
        assert reads.search(bad), bad  # it finds them


def test_fault_injection_lives_in_the_tests_not_in_jdp():
    """The tests inject faults through a callback of their own (tests/inject.py); jdp has no fault code."""
    offenders = [name for name, path in MODULES.items() if "JDP_TEST_" in path.read_text()]
    assert offenders == [], f"JDP_TEST_* read in jdp/: {offenders}"
    assert "JDP_TEST_KILL" in (Path(__file__).parent / "inject.py").read_text()  # the check looks for the right name


def test_no_function_is_longer_than_a_screen():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def test_the_command_line_starts_without_importing_jax():
    program = (
        "import sys\nfrom jdp.cli import main\n"
        "for argv in (['--help'], ['train', '--help'], ['plan', '--help'], ['generate', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "import jdp\njdp.__version__\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax', 'orbax')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout.strip().splitlines()[-1]


def test_library_names_load_on_first_use():
    out = subprocess.run(
        [sys.executable, "-c", "import jdp; print(jdp.make_train_step.__module__, jdp.parallel.__name__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["jdp.parallel.parallelize", "jdp.parallel"]
