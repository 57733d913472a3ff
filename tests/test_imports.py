"""Imports go one way (DESIGN.md): no two of the project's modules import each other, directly or
round a longer loop, counting every import in a file (inside functions and `if __name__ == "__main__":`
too: a loop there is still one in the code's structure). Read with `ast`, nothing imported."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def project_modules() -> dict:
    """{dotted name: file}: the top-level modules, the kernels package, tools/ and sweeps/*.py."""
    files = [*ROOT.glob("*.py"), *ROOT.glob("kernels/*.py"), *ROOT.glob("tools/**/*.py"), *ROOT.glob("sweeps/*.py")]
    modules = {}
    for file in files:
        parts = list(file.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = file
    return modules


def imports(name: str, file: Path, modules: dict) -> dict:
    """{project module it imports: the first line that does}, its own name left out."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = {}
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per dot after the first
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules or not base else base
                       for alias in node.names]  # a submodule, else a name in base
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c`: the deepest of a, a.b, a.b.c we have
                target = target.rpartition(".")[0]
            if target and target != name:
                found.setdefault(target, node.lineno)
    return found


def loops(graph: dict) -> list:
    """Each strongly connected component of more than one module (Tarjan), sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_reader_finds_imports_inside_functions_and_relative_ones(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "a.py").write_text("def main():\n    import b\n")
    (tmp_path / "b.py").write_text("if __name__ == '__main__':\n    from pkg import c\n")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "c.py").write_text("from . import d\nfrom .d import x\nimport os\n")
    (tmp_path / "pkg" / "d.py").write_text("import a.sub\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py", "pkg": tmp_path / "pkg" / "__init__.py",
               "pkg.c": tmp_path / "pkg" / "c.py", "pkg.d": tmp_path / "pkg" / "d.py"}
    graph = {name: imports(name, file, modules) for name, file in modules.items()}
    assert graph == {"a": {"b": 2}, "b": {"pkg.c": 2}, "pkg": {}, "pkg.c": {"pkg.d": 1}, "pkg.d": {"a": 1}}
    assert loops(graph) == [["a", "b", "pkg.c", "pkg.d"]]
    assert loops({**graph, "pkg.d": {}}) == []


def test_no_two_project_modules_import_each_other():
    modules = project_modules()
    assert {"sweep", "search", "train", "kernels", "kernels.reference", "tools.nanogpt"} <= set(modules)
    graph = {name: imports(name, file, modules) for name, file in modules.items()}
    assert {"config", "ledger"} <= set(graph["train"]) and "kernels.nki_common" in graph["kernels.nki_relu2"]
    found = loops(graph)
    assert not found, "import loops:\n" + "\n".join(
        ", ".join(f"{v} -> {w} ({modules[v].relative_to(ROOT)}:{graph[v][w]})"
                  for v in loop for w in graph[v] if w in loop) for loop in found)
