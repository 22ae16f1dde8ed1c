"""The layout rules of README's "Layout", checked from the source so that they stay true.

Imports run one way: cli / flows -> runner -> stages -> io, llm, models -> core. Commands that read finished
runs (atlas.tools) sit above the stages; the trainer (atlas.cblm) reads token shards through atlas.io. Imports
inside functions count: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, write_config, write_jsonl

PACKAGE = REPO / "atlas"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """atlas module -> the atlas modules it imports, anywhere in its source (``from a import b`` counts a.b when
    b is a module)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "atlas"


GRAPH = import_graph()


def test_the_graph_is_read_from_every_module():
    assert {"atlas.cli", "atlas.runner", "atlas.stages.chunk", "atlas.io.tokens", "atlas.cblm.data"} <= set(GRAPH)
    assert "atlas.io.tokens" in GRAPH["atlas.cblm.data"]  # a module-level import
    assert "atlas.models.ivfpq" in GRAPH["atlas.stages.index"]  # an import inside a function


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    assert find_cycle(GRAPH) is None


ALLOWED = {  # what each layer may import (besides itself and atlas.config)
    "core": set(),
    "io": {"core"},
    "llm": {"core", "models"},  # the offline engine embeds with models.embedder
    "models": {"core", "io", "llm"},  # the judge and the labeler ask an engine
    "stages": {"core", "io", "llm", "models"},
    "cblm": {"core", "io", "models", "tools"},  # tools: cblm/cli refreshes the run report
    "tools": {"core", "io", "llm", "models", "stages", "runner", "tools"},
}


@pytest.mark.parametrize("which", sorted(ALLOWED))
def test_layers_import_only_what_is_below_them(which):
    wrong = sorted(f"{name} -> {target}" for name, targets in GRAPH.items() if layer(name) == which
                   for target in targets
                   if layer(target) not in ALLOWED[which] | {which, "config", "atlas"})
    assert not wrong


def test_a_stage_imports_no_other_stage_and_no_command():
    wrong = sorted(f"{name} -> {target}" for name, targets in GRAPH.items() if name.startswith("atlas.stages.")
                   for target in targets if target.startswith("atlas.stages") or layer(target) in ("tools", "cli"))
    assert not wrong


def test_commands_are_imported_only_by_the_cli_and_other_commands():
    importers = {"atlas.cli", "atlas.cblm.cli", "atlas.api"}  # the Python API sits beside the CLI
    wrong = sorted(f"{name} -> {target}" for name, targets in GRAPH.items() for target in targets
                   if layer(target) == "tools" and name not in importers and layer(name) != "tools")
    assert not wrong


def test_nothing_in_the_library_imports_the_python_api():
    """atlas.api is a facade for users; the package root only re-exports its names lazily (``atlas.run``)."""
    assert sorted(name for name, targets in GRAPH.items() if "atlas.api" in targets) == ["atlas"]


def test_the_trainer_reads_token_shards_through_io_only():
    cblm = {name: targets for name, targets in GRAPH.items() if layer(name) == "cblm"}
    assert not [t for targets in cblm.values() for t in targets if t.startswith("atlas.stages")]
    assert "atlas.io.tokens" in GRAPH["atlas.cblm.data"]


def test_output_folders_are_named_once():
    """Stage outputs are atlas.io.layout constants: no stage or command spells a folder name itself."""
    from atlas.io import layout
    from atlas.stages import STAGES

    names = {v for k, v in vars(layout).items() if k.isupper()}
    assert {stage.output for stage in STAGES.values()} <= names
    spelled = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("output_dir", "part_path"):
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and first.value in names:
                    spelled.append(f"{path.relative_to(REPO)}:{node.lineno} {first.value!r}")
    assert not spelled


# A core install: the modules of every extra are missing. A meta path finder makes them unimportable in a
# subprocess, which is what `pip install -e .` without extras gives (checked by hand once, see README).
BLOCKED = ("torch", "sentence_transformers", "safetensors", "transformers", "faiss", "community", "networkx",
           "sklearn", "scipy", "matplotlib", "ray", "prefect_ray", "vllm")
CORE_ONLY = textwrap.dedent(f"""
    import sys
    BLOCKED = {BLOCKED!r}

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

    sys.meta_path.insert(0, Blocker())
    from atlas.cli import main
    code = main(sys.argv[1:])
    leaked = sorted(m for m in BLOCKED if m in sys.modules)
    assert not leaked, leaked
    sys.exit(code)
""")


def core_only(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CORE_ONLY, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO)


def test_core_install_runs_help_and_the_chunk_stage(tmp_path, demo_records):
    assert core_only("--help").returncode == 0
    config = write_config(tmp_path, write_jsonl(tmp_path / "docs.jsonl", demo_records[:6]))
    done = core_only("run", str(config), "--stages", "chunk", "--inline")
    assert done.returncode == 0, done.stderr
    assert sorted((tmp_path / "run" / "chunks").glob("part-*.parquet"))

    refused = core_only("run", str(config), "--stages", "tag", "--inline")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "stage 'tag' needs the 'embed' extra" in refused.stderr
    assert "pip install 'atlas-concepts[embed]'" in refused.stderr
    assert not (tmp_path / "run" / "tags").exists()  # refused before it wrote anything
