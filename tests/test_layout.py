"""The engine's layout rules, checked on the source: no import cycles between engine modules, one module that reads
the environment, and no engine file over a few hundred lines without a stated reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"


def engine_imports() -> dict[str, set[str]]:
    """Each engine module and the engine modules it imports (anywhere in it, deferred imports included)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in ENGINE.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[name] |= {t for t in targets if t in modules and t not in (name, "engine")}
    return edges


def test_no_engine_module_imports_one_that_imports_it_back():
    edges = engine_imports()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo += edges[m]
        return False

    cycles = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if reaches(b, a))
    assert cycles == []


def test_no_engine_module_below_serving_imports_it():
    """The runtime (engine, scheduler, runner, models, ops, io) never imports the serving layer above it: the words
    both use are `engine.vocabulary`'s. Only the package's lazy exports (engine/__init__.py) name serving modules."""
    upward = sorted(f"{m} -> {t}" for m, targets in engine_imports().items() for t in targets
                    if t.startswith("engine.serving") and not m.startswith("engine.serving") and m != "engine")
    assert upward == []


# The image's build step (`python -m engine.startup.prebuild`) is a program, not the engine's runtime: it points its own
# Triton cache and its compilers' at --out, and hands its environment to them.
ENVIRONMENT_READERS = {"engine/options.py", "engine/startup/prebuild.py"}


def test_only_the_options_module_reads_the_environment():
    modules = {str(p.relative_to(ROOT)): p for p in ENGINE.rglob("*.py")}
    readers = [name for name, p in modules.items()
               if name not in ENVIRONMENT_READERS and re.search(r"\benviron\b|getenv\(", p.read_text())]
    assert readers == []


def test_the_supervisor_starts_its_workers_without_torch():
    """Building the workers' engine config and options (what the service's supervisor pickles to spawn them) imports
    no torch: the supervisor spawns its workers first, and torch's import there would delay their start (a fresh
    interpreter: this one has torch)."""
    import subprocess
    import sys

    code = ("import pickle, sys\n"
            "from engine.serving.voxcpm import engine_config\n"
            "from engine.serving.processes import WorkerSet, reserve_cpus\n"
            "from engine.serving.protocol import WorkerOptions\n"
            "config = engine_config(dtype='bfloat16', max_num_seqs=8)\n"
            "pickle.dumps(WorkerOptions(model_path='m', device='cuda:0', engine=config, address='a', authkey=b'k'))\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"torch imported: {r.stdout.strip()[:300]}"


def test_the_api_processes_import_no_torch():
    """An API process (the app, the engine client with its tokenizer) imports no torch: 14-16 of them share a host's
    memory and start beside the workers (a fresh interpreter: this one has torch)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import service.app, service.supervisor, engine.serving.client, engine.io.tokenizer\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"torch imported: {r.stdout.strip()[:300]}"


# A module of the engine is one idea of at most a few hundred lines; a longer one says in its docstring why it is one
# file ("One file because ...").
ENGINE_FILE_LINES = 450
LONG_FILE_REASON = "One file because"


def test_no_long_engine_file_without_a_reason():
    long = []
    for path in sorted(ENGINE.rglob("*.py")):
        name, text = str(path.relative_to(ROOT)), path.read_text()
        lines = len(text.splitlines())
        if lines > ENGINE_FILE_LINES and LONG_FILE_REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{name}: {lines} lines")
    assert long == [], f"over {ENGINE_FILE_LINES} lines without '{LONG_FILE_REASON} ...' in the docstring: {long}"


# The docs are a report, not a log: a new result replaces the row it supersedes, and the history lives in
# docs/history/ and the commit log.
DOC_LINE_LIMITS = {"docs/benchmarks.md": 400, "README.md": 250}
RESULT_FILES_LIMIT = 60
# Runs and changes are named by date, commit and hardware, never by work counters or machine-kind labels.
COUNTER = re.compile(r"\b(?:sessions?|items?|runs?|profile steps?|calls?|issues?)\s+[0-9]+\b"
                     r"|\bnvidia-h[0-9]+|\bdevice (?:call|tool)s?\b", re.IGNORECASE)


def test_the_docs_stay_short():
    for name, limit in DOC_LINE_LIMITS.items():
        lines = len((ROOT / name).read_text().splitlines())
        assert lines <= limit, f"{name}: {lines} lines, at most {limit}"
    files = [p for p in (ROOT / "docs" / "results").rglob("*") if p.is_file()]
    assert len(files) <= RESULT_FILES_LIMIT, f"docs/results holds {len(files)} files, at most {RESULT_FILES_LIMIT}"


def test_no_work_counters_in_the_docs_or_the_code():
    paths = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "docs" / "history").glob("*.md")]
    paths += [p for d in ("engine", "service", "tools") for p in (ROOT / d).rglob("*")
              if p.suffix in (".py", ".sh", ".md")]
    found = [f"{p.relative_to(ROOT)}:{n}: {m.group(0)}" for p in paths
             for n, line in enumerate(p.read_text().splitlines(), 1) for m in COUNTER.finditer(line)]
    assert found == []


def test_each_engine_field_has_one_default():
    """EngineConfig defines each engine field's default once: no engine or service function repeats one as a
    parameter default (None, "not given", is no default), `from_pretrained` takes the fields as keywords,
    `ModelRunner` the config whole, and the service's engine settings carry the config's defaults, bounds and docs
    (their own default only where the one SERVICE_DEFAULTS table says so)."""
    import dataclasses
    import inspect

    from engine.engine_config import ENGINE_FIELDS, EngineConfig
    from engine.runner.model_runner import ModelRunner
    from engine.serving.voxcpm import VoxCPM
    from service.settings import ENGINE_SETTINGS, SERVICE_DEFAULTS, Settings

    repeated = []
    for path in [*ENGINE.rglob("*.py"), *(ROOT / "service").rglob("*.py")]:
        if path.name == "engine_config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults
                defaults += node.args.kw_defaults
                repeated += [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({a.arg}=...)"
                             for a, d in zip(args, defaults, strict=True)
                             if a.arg in ENGINE_FIELDS and d is not None and ast.unparse(d) != "None"]
    assert repeated == []
    assert list(inspect.signature(VoxCPM.from_pretrained).parameters) == ["model", "devices", "options"]
    assert list(inspect.signature(ModelRunner.__init__).parameters) == ["self", "model", "config", "device"]
    config = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert set(ENGINE_SETTINGS.values()) <= ENGINE_FIELDS and set(SERVICE_DEFAULTS) <= set(ENGINE_SETTINGS.values())
    for name, field in ENGINE_SETTINGS.items():
        setting = Settings.model_fields[name]
        assert setting.default == SERVICE_DEFAULTS.get(field, config[field].default), name
        assert setting.description == config[field].metadata["doc"], name


def test_the_process_boundary_is_typed():
    """What crosses between a worker and its clients is typed: no message or report field is `Any` or a string-keyed
    dict of anything, and every call names the worker method that answers it."""
    from engine.serving import protocol, reports, worker

    loose = []
    for module in (protocol, reports):
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and re.search(r"\bAny\b|dict\[str, Any\]", ast.unparse(node.annotation)):
                loose.append(f"{module.__name__}:{node.lineno} {ast.unparse(node)}")
    assert loose == []
    calls = [c for c in vars(protocol).values() if isinstance(c, type) and issubclass(c, protocol.Call)
             and c is not protocol.Call]
    assert calls and all(callable(getattr(worker.Worker, c.method, None)) for c in calls)


def test_tools_are_entry_points_over_packages():
    """tools/ is a toolbox: the benchmarks are subcommands of tools/bench.py (no bench_*.py beside it), the profilers of
    tools/profiler.py, each module of their packages reached by a subcommand; the scripts that stage and run work on a
    GPU host are in tools/gpu_host/; what the image and the systemd unit run lives with production code, not in
    tools/."""
    import importlib

    from tools import bench, profiler

    tools = ROOT / "tools"
    assert sorted(p.name for p in tools.glob("bench_*.py")) == []
    assert sorted(str(p.relative_to(ROOT)) for p in tools.rglob("*.sh") if p.parent != tools / "gpu_host") == []
    for package, entry in (("benchmarks", bench), ("profiling", profiler)):
        modules = {p.stem for p in (tools / package).glob("*.py")} - {"__init__", "harness"}
        targets = [target.split(":") for target, _ in entry.SUBCOMMANDS.values()]
        assert modules == {module for module, _ in targets}, package
        for module, function in targets:
            assert callable(getattr(importlib.import_module(f"tools.{package}.{module}"), function))
    deployment = [p for p in (ROOT / "deployment").rglob("*") if p.suffix in (".yaml", ".yml", ".service", ".sh")]
    for path in [ROOT / "Dockerfile", *deployment]:
        assert not re.search(r"\btools\b", path.read_text()), f"{path.relative_to(ROOT)} runs something in tools/"
