"""Imports go one way: transport <- connector <- vllm adapter (cli, harness
and bench may use any layer; selftest any but the vLLM adapter and the CLI).

Read from the source with ``ast`` (every ``import`` statement, at module
level, under ``if TYPE_CHECKING`` and inside functions), never by importing
the modules: a wrong-way import fails here even on a machine without UCX or
vLLM. The rules, as the code keeps them:

- ``rdma_kv.errors`` imports nothing from ``rdma_kv``.
- ``rdma_kv.transport`` imports nothing from ``rdma_kv`` but itself,
  ``rdma_kv.errors`` and ``rdma_kv.runs`` (the run-merging rule, numpy only);
  inside it, no part imports ``agent.py``, the façade over them.
- ``rdma_kv.connector`` never imports ``rdma_kv.vllm``, ``harness``, ``cli``
  or ``bench``, and reaches the transport through two doors only:
  ``connector/rdma/transport_api.py`` (the Protocol the worker needs, and the
  descriptor lists the slot tables are built from) and the function
  ``agent_transport`` in ``connector/rdma/connector.py`` (which builds the
  real ``Agent``, lazily).
- Nothing outside ``rdma_kv.vllm`` imports ``vllm``; nothing outside
  ``rdma_kv.ray`` imports ``ray``, and ``rdma_kv.ray`` imports no other
  part of rdma-kv (the Ray backend only sets ports, ids and hosts).
- ``rdma_kv.selftest`` imports neither ``rdma_kv.vllm`` nor ``rdma_kv.cli``
  (the CLI builds on it), except its ``__main__``, which hands over to the CLI.
- Roles inside the RDMA connector: the consumer's modules
  (``connector/rdma/consumer/``) never import the producer's (``producer``,
  ``leases``, ``leaserecords``, ``leasetokens``, ``leasepins``, ``tombstones``, ``leaseheap``, ``sidechannel``, ``sidehandler``, ``sideconn``, ``sidetrust``, ``admission``,
  ``pusher``, ``pushreg``, ``pushstate``), nor the producer's the consumer's; only ``worker`` (which routes a step to both) and the modules
  both share (``wire``, ``meta``, ``stats``...) sit between them.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "rdma_kv"

TRANSPORT_DOORS = {
    # module -> the functions it may import the transport in (None: anywhere in the module)
    "rdma_kv.connector.rdma.transport_api": None,
    "rdma_kv.connector.rdma.connector": {"agent_transport"},
}


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module, absolute
    line: int
    function: str | None  # the innermost enclosing function, None at module level

    def __str__(self) -> str:
        where = f" in {self.function}()" if self.function else ""
        return f"{self.module}:{self.line}{where} imports {self.target}"


def module_name(path: pathlib.Path, src: pathlib.Path = SRC) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, src: pathlib.Path = SRC) -> list[Import]:
    name = module_name(path, src)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(name, alias.name, child.lineno, function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                # ``from pkg import mod`` may import a submodule: count both names.
                found.append(Import(name, target, child.lineno, function))
                found.extend(Import(name, f"{target}.{alias.name}", child.lineno, function)
                             for alias in child.names if alias.name != "*")
            visit(child, function)

    visit(ast.parse(path.read_text(), filename=str(path)), None)
    return found


def is_under(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


ALL_IMPORTS = [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in imports_of(path)]


def existing(target: str) -> bool:
    """``target`` is a module or package of rdma_kv (not a name inside one)."""
    rel = pathlib.Path(*target.split("."))
    return (SRC / rel).is_dir() or (SRC / rel).with_suffix(".py").is_file()


def rdma_kv_modules_imported_by(package: str) -> list[Import]:
    return [imp for imp in ALL_IMPORTS
            if is_under(imp.module, package) and is_under(imp.target, "rdma_kv") and existing(imp.target)]


def test_the_parser_sees_every_kind_of_import(tmp_path):
    """The walk finds module-level, TYPE_CHECKING, function-level and
    relative imports (or the rules below could pass by seeing nothing)."""
    pkg = tmp_path / "rdma_kv" / "connector"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    mod = pkg / "probe.py"
    mod.write_text("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from rdma_kv.transport import Agent\n"
                   "def f():\n    import vllm\n    def g():\n        from ..transport import lanes\n"
                   "from . import geometry\n")
    got = {(i.target, i.function) for i in imports_of(mod, tmp_path)}
    assert {("os", None), ("rdma_kv.transport", None), ("rdma_kv.transport.Agent", None),
            ("vllm", "f"), ("rdma_kv.transport", "g"), ("rdma_kv.transport.lanes", "g"),
            ("rdma_kv.connector", None), ("rdma_kv.connector.geometry", None)} <= got


def test_the_walk_covers_the_package():
    modules = {imp.module for imp in ALL_IMPORTS}
    for module in ("rdma_kv.errors", "rdma_kv.transport.agent", "rdma_kv.connector.rdma.worker",
                   "rdma_kv.connector.rdma.consumer", "rdma_kv.vllm.connector"):
        assert module in modules, f"{module} was not parsed"
    # The doors are really used (a rule about them that matched nothing would prove nothing).
    doors = {i.module for i in rdma_kv_modules_imported_by("rdma_kv.connector") if is_under(i.target, "rdma_kv.transport")}
    assert doors == set(TRANSPORT_DOORS)


@pytest.mark.parametrize("bottom", ["rdma_kv.errors", "rdma_kv.runs"])
def test_the_bottom_modules_import_nothing_from_rdma_kv(bottom):
    wrong = [str(i) for i in rdma_kv_modules_imported_by(bottom)]
    assert not wrong, f"{bottom} is the bottom of every layer:\n" + "\n".join(wrong)


def test_transport_imports_only_itself_errors_and_runs():
    wrong = [str(i) for i in rdma_kv_modules_imported_by("rdma_kv.transport")
             if not (is_under(i.target, "rdma_kv.transport")
                     or i.target in ("rdma_kv", "rdma_kv.errors", "rdma_kv.runs"))]
    assert not wrong, ("the transport knows nothing of blocks, connectors or vLLM; it may import "
                       "rdma_kv.errors and rdma_kv.runs only:\n" + "\n".join(wrong))


def test_no_transport_part_imports_the_agent():
    """The agent is a façade over parts; a part that imported it (even for
    typing) would be reaching back into it. Only the package re-exports it."""
    wrong = [str(i) for i in rdma_kv_modules_imported_by("rdma_kv.transport")
             if is_under(i.target, "rdma_kv.transport.agent")
             and i.module not in ("rdma_kv.transport", "rdma_kv.transport.agent")]
    assert not wrong, "transport parts must not import agent.py:\n" + "\n".join(wrong)


@pytest.mark.parametrize("upper", ["rdma_kv.vllm", "rdma_kv.ray", "rdma_kv.harness", "rdma_kv.cli",
                                   "rdma_kv.bench", "rdma_kv.selftest"])
def test_connector_never_imports_an_upper_layer(upper):
    wrong = [str(i) for i in rdma_kv_modules_imported_by("rdma_kv.connector") if is_under(i.target, upper)]
    assert not wrong, f"the connector is below {upper}; move the code or invert the call:\n" + "\n".join(wrong)


def test_connector_reaches_the_transport_only_through_its_doors():
    wrong = []
    for imp in rdma_kv_modules_imported_by("rdma_kv.connector"):
        if not is_under(imp.target, "rdma_kv.transport"):
            continue
        if imp.module in TRANSPORT_DOORS:
            functions = TRANSPORT_DOORS[imp.module]
            if functions is None or imp.function in functions:
                continue
        wrong.append(str(imp))
    assert not wrong, ("the connector imports rdma_kv.transport only in connector/rdma/transport_api.py "
                       "and in connector.agent_transport(); import what you need from transport_api:\n"
                       + "\n".join(wrong))


CONSUMER = ("rdma_kv.connector.rdma.consumer",)
PRODUCER = ("rdma_kv.connector.rdma.producer", "rdma_kv.connector.rdma.leases",
            "rdma_kv.connector.rdma.leaserecords", "rdma_kv.connector.rdma.leasetokens",
            "rdma_kv.connector.rdma.leasepins",
            "rdma_kv.connector.rdma.tombstones", "rdma_kv.connector.rdma.leaseheap",
            "rdma_kv.connector.rdma.sidechannel", "rdma_kv.connector.rdma.sidehandler",
            "rdma_kv.connector.rdma.sideconn",
            "rdma_kv.connector.rdma.sidetrust", "rdma_kv.connector.rdma.admission",
            "rdma_kv.connector.rdma.pusher", "rdma_kv.connector.rdma.pushreg", "rdma_kv.connector.rdma.pushstate",
            "rdma_kv.connector.rdma.fences")


@pytest.mark.parametrize("role, other", [(CONSUMER, PRODUCER), (PRODUCER, CONSUMER)], ids=["consumer", "producer"])
def test_the_connectors_roles_do_not_import_each_other(role, other):
    mine = [i for package in role for i in rdma_kv_modules_imported_by(package)]
    assert mine, f"no module of {role} was parsed"  # the rule would prove nothing
    wrong = [str(i) for i in mine if any(is_under(i.target, o) for o in other)]
    assert not wrong, ("the consumer's and the producer's modules never import each other; move what both "
                       "need into a shared module (wire, meta, stats...):\n" + "\n".join(wrong))


def test_selftest_imports_neither_the_vllm_adapter_nor_the_cli():
    wrong = [str(i) for i in rdma_kv_modules_imported_by("rdma_kv.selftest")
             if (is_under(i.target, "rdma_kv.vllm") or is_under(i.target, "rdma_kv.cli"))
             and i.module != "rdma_kv.selftest.__main__"]
    assert not wrong, "rdma_kv.selftest sits below the CLI and beside the vLLM adapter:\n" + "\n".join(wrong)


def test_only_the_vllm_adapter_imports_vllm():
    wrong = [str(i) for i in ALL_IMPORTS
             if is_under(i.target, "vllm") and not is_under(i.module, "rdma_kv.vllm")]
    assert not wrong, "only rdma_kv.vllm may import vllm:\n" + "\n".join(wrong)


def test_only_the_ray_backend_imports_ray_and_it_imports_no_other_layer():
    wrong = [str(i) for i in ALL_IMPORTS if is_under(i.target, "ray") and not is_under(i.module, "rdma_kv.ray")]
    wrong += [str(i) for i in rdma_kv_modules_imported_by("rdma_kv.ray") if not is_under(i.target, "rdma_kv.ray")]
    assert not wrong, "only rdma_kv.ray imports ray, and it imports nothing else of rdma-kv:\n" + "\n".join(wrong)


def test_py_typed_is_shipped():
    assert (PACKAGE / "py.typed").is_file()
    pyproject = (SRC.parent / "pyproject.toml").read_text()
    assert '"rdma_kv" = [' in pyproject and '"py.typed"' in pyproject.partition('"rdma_kv" = [')[2].partition("]")[0]
