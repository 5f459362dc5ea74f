"""The layering rule of kvstore/__init__.py: a module imports only from its own package or a lower
layer (every import, lazy and TYPE_CHECKING ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstore

PKG = Path(kvstore.__file__).parent


def layer_of() -> dict[str, int]:
    return {name: i for i, names in enumerate(kvstore._LAYERS) for name in names}


def imports(path: Path, root: Path = PKG.parent) -> list[tuple[int, str]]:
    """(line, top-level kvstore module) of every import of a kvstore module in ``path``, a file of
    the package ``kvstore`` under ``root``."""
    mod = path.relative_to(root).with_suffix("").parts
    pkg = mod[:-1] if path.name != "__init__.py" else mod[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(pkg[:len(pkg) - node.level + 1])
                target = base + (node.module.split(".") if node.module else [])
                if len(target) == 1:  # "from . import x" at the top: x is the module
                    target += [node.names[0].name]
            else:
                target = (node.module or "").split(".")
            if target[0] == "kvstore" and len(target) > 1:
                out.append((node.lineno, target[1]))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "kvstore" and len(parts) > 1:
                    out.append((node.lineno, parts[1]))
    return out


def test_every_package_has_a_layer() -> None:
    layers = layer_of()
    tops = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert tops == set(layers), f"without a layer: {tops - set(layers)}; gone: {set(layers) - tops}"


def test_no_module_imports_upward() -> None:
    layers = layer_of()
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts == ("__init__.py",):
            continue  # the package's face re-exports the public API
        own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for line, target in imports(path):
            if target != own and layers[target] >= layers[own]:
                bad.append(f"{rel}:{line} ({own}, layer {layers[own]}) imports {target} (layer {layers[target]})")
    assert not bad, "\n".join(bad)


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The check itself fails on what it is there to catch (shm importing the service)."""
    f = PKG / "shm" / "index.py"
    assert ("service" not in [t for _l, t in imports(f)])
    # the probe lies in a copy of the package's place, not in the package (mypy may be reading it)
    fake = tmp_path / "kvstore" / "shm" / "_layer_probe.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from ..service import supervisor\nfrom kvstore.client import KVCacheClient\n")
    assert [t for _l, t in imports(fake, tmp_path)] == ["service", "client"]
