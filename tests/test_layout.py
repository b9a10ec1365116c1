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


def test_only_the_options_module_reads_the_environment():
    readers = [str(p.relative_to(ROOT)) for p in ENGINE.rglob("*.py")
               if p.name != "options.py" and re.search(r"\benviron\b|getenv\(", p.read_text())]
    assert readers == []


def test_the_supervisor_starts_its_workers_without_torch():
    """Building the workers' engine config and options (what the service's supervisor pickles to spawn them) imports
    no torch: the supervisor spawns its workers first, and torch's import there would delay their start (a fresh
    interpreter: this one has torch)."""
    import subprocess
    import sys

    code = ("import pickle, sys\n"
            "from engine.serving.pool import engine_config\n"
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
# Being split by job: these leave the list as they are.
LONG_FILES_BEING_SPLIT = {"engine/serving/worker.py", "engine/serving/pool.py", "engine/serving/client.py"}


def test_no_long_engine_file_without_a_reason():
    long = []
    for path in sorted(ENGINE.rglob("*.py")):
        name, text = str(path.relative_to(ROOT)), path.read_text()
        lines = len(text.splitlines())
        if lines > ENGINE_FILE_LINES and name not in LONG_FILES_BEING_SPLIT \
                and LONG_FILE_REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{name}: {lines} lines")
    assert long == [], f"over {ENGINE_FILE_LINES} lines without '{LONG_FILE_REASON} ...' in the docstring: {long}"


# The docs are a report, not a log: a new result replaces the row it supersedes, and the history lives in
# docs/history/ and the commit log.
DOC_LINE_LIMITS = {"docs/benchmarks.md": 400, "README.md": 250}
RESULT_FILES_LIMIT = 60
# Runs and changes are named by date, commit and hardware, never by work counters or machine-kind labels.
COUNTER = re.compile(r"\b(?:sessions?|items?|runs?|profile steps?|calls?)\s+[0-9]+\b"
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
