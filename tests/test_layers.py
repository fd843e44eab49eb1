"""The house rule: quantkit is a stack of layers and every import points down (or stays in its layer), with no
cycle between modules and no private name used outside its module.

    core < schemes < kernels < nn < models < algorithms < calibration < checkpoint < gguf < run < integrations < app

core: errors, bit packing, group arithmetic, QuantResult, registries. schemes: one file per quantizer (its fit,
round, dequantize and kernel decode). kernels: Triton GEMMs and their torch references. nn: the quantized linears.
models: architecture tables, reading a source model. algorithms: rtn, gptq, awq. calibration: the block loop.
checkpoint: one file per codec, files and shards. gguf: llama.cpp's format whole: its block types as quantizers and
their bytes, its file, names and codec, above both registries it fills (schemes' quantizers, checkpoint's codecs).
run: the quantize pipeline, resume, staging, convert, loading.
integrations: quantkit's formats in other tools' loaders (transformers' quantizer registry). app: the public API, the CLI, evaluation.
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["core", "schemes", "kernels", "nn", "models", "algorithms", "calibration", "checkpoint", "gguf", "run",
          "integrations", "app"]
# Modules that may import lazily inside functions: the CLI keeps `quantkit --help` free of torch's import time,
# and the package root loads the API on first use. Modules that import triton (optional: CPU-only platforms lack
# it) may be imported lazily by anyone.
LAZY_IMPORTERS = {"quantkit.cli", "quantkit"}
LAZY_TARGET = "quantkit.kernels.triton_"


def _modules() -> dict:
    """{dotted module name: source path} of the installed package (kernels/ installs as quantkit.kernels)."""
    found = {}
    for folder, package in ((ROOT / "quantkit", "quantkit"), (ROOT / "kernels", "quantkit.kernels")):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else LAYERS.index("app")


def _imports(module: str, path: Path):
    """(imported module, name or None, line, inside a function) for every quantkit import of a module."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "quantkit":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                target, name = (sub, None) if sub in MODULES else (node.module, alias.name)
                yield target, name, node.lineno, id(node) in nested
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "quantkit":
                    yield alias.name, None, node.lineno, id(node) in nested


def test_every_import_points_down():
    upward = []
    for module, path in MODULES.items():
        for target, _, line, _ in _imports(module, path):
            if layer_of(target) > layer_of(module):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[layer_of(module)]}) imports {target} "
                              f"({LAYERS[layer_of(target)]})")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = {m: {t for t, _, _, _ in _imports(m, p) if t in MODULES and t != m and not m.startswith(t + ".")}
             for m, p in MODULES.items()}
    # a package's __init__ importing its own modules (registration) is not a cycle with them
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _private_uses(module: str, path: Path) -> list:
    """Where the file at `path` imports or reads a private name of a quantkit module other than `module`."""
    used = []
    for target, name, line, _ in _imports(module, path):
        if name and name.startswith("_") and not name.startswith("__") and target != module:
            used.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{name}")
    tree = ast.parse(path.read_text())
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
               and n.module.startswith("quantkit") for a in n.names if f"{n.module}.{a.name}" in MODULES}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            used.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    return used


def test_no_private_names_across_modules():
    used = [use for module, path in MODULES.items() for use in _private_uses(module, path)]
    assert not used, "private names used outside their module:\n" + "\n".join(used)


def test_scripts_use_the_public_api():
    """The benchmarks and tools in scripts/ are quantkit's users too: no private name of a quantkit module."""
    used = [use for path in sorted((ROOT / "scripts").rglob("*.py")) for use in _private_uses("", path)]
    assert not used, "private names of quantkit used by scripts:\n" + "\n".join(used)


def test_library_imports_at_the_top():
    """A function-local import of quantkit hides a cycle or an upward arrow from a reader; only the CLI defers."""
    lazy = [f"{path.relative_to(ROOT)}:{line} imports {target}" for module, path in MODULES.items()
            if module not in LAZY_IMPORTERS for target, _, line, inside in _imports(module, path)
            if inside and not target.startswith(LAZY_TARGET)]
    assert not lazy, "function-local quantkit imports:\n" + "\n".join(lazy)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule above would fail for a scheme importing the checkpoint layer (a guard on the checker itself)."""
    assert layer_of("quantkit.checkpoint.gptq") > layer_of("quantkit.schemes.grid")
    assert layer_of("quantkit.kernels.codebook") == LAYERS.index("kernels")
    assert layer_of("quantkit.api") == layer_of("quantkit.cli") == LAYERS.index("app")
    assert "quantkit.kernels.codebook" in MODULES and "quantkit.core.registry" in MODULES
    # llama.cpp's quantizers and codec sit above the registries they fill, so neither registry's layer imports them
    assert layer_of("quantkit.gguf.kquants") > layer_of("quantkit.checkpoint.codecs") > layer_of("quantkit.schemes.base")
    assert layer_of("quantkit.gguf.codec") < layer_of("quantkit.run.config") and "quantkit.gguf.codec" in MODULES


def _layout_rows() -> dict:
    """{layer: the module names README.md's Layout block lists for it}. A row is a layer's name then its modules,
    continued on indented lines; items are split by '·' and ';', a '+' joins two modules, parentheses are notes and
    a 'label:' before a module is prose."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    rows, layer = {}, None
    for line in block.splitlines():
        head = line.split(maxsplit=1)[0].rstrip("/") if line and not line[0].isspace() else None
        if head is not None:
            layer = head if head in LAYERS else None
            rows[layer] = line.split(maxsplit=1)[1] if layer else ""
        elif layer:
            rows[layer] += " " + line.strip()
    names = {}
    for layer, row in rows.items():
        if layer is None:
            continue
        plain = re.sub(r"\([^()]*\)", " ", row)
        items = [item.rsplit(":", 1)[-1] for item in re.split(r"[·;]", plain)]
        names[layer] = {part.split()[0] for item in items for part in item.split("+") if part.split()}
    return names


def test_readme_layout_lists_every_module_where_it_is():
    """README's Layout block names each module of a layer, and nothing that is not one: it cannot fall behind."""
    listed = _layout_rows()
    actual = {layer: set() for layer in LAYERS}
    for module in MODULES:
        parts = module.split(".")
        if len(parts) > 2:
            actual[parts[1]].add(parts[-1])
        elif len(parts) == 2 and parts[1] not in LAYERS:
            actual["app"].add(parts[1])
    problems = [f"{layer}: README names {sorted(listed.get(layer, set()) - actual[layer])}, which are no modules of "
                f"it, and misses {sorted(actual[layer] - listed.get(layer, set()))}"
                for layer in LAYERS if listed.get(layer, set()) != actual[layer]]
    assert not problems, "README.md's Layout block is not the code's:\n" + "\n".join(problems)
