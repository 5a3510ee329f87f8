"""The reference parts of the docs against the code they describe: the
configuration tables (keys and defaults), the wire protocol's messages and
version, the module table of the RDMA connector, every ``rdma_kv.*`` name a
document cites, the UCX defaults an operator is told rdma-kv sets, and the
log and error lines docs/deploy.md's troubleshooting section says are
quoted from the source. Each check reads the code's own constants, so a
key, field or module added, renamed or removed in one place and not the
other fails here."""

from __future__ import annotations

import ast
import dataclasses
import errno
import importlib
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.rdma import versions, wire
from rdma_kv.connector.rdma.settings import EXTRA_KEYS, USER_KEYS, RdmaSettings
from rdma_kv.transport.ucx import DEFAULT_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src"


def _text(name: str) -> str:
    return (ROOT / name).read_text()


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The rows (cells, stripped) of the first Markdown table after ``marker``,
    header and rule excluded."""
    rows: list[list[str]] = []
    started = False
    for line in text[text.index(marker):].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif started:
            break
    return rows[1:]  # the header


def _keys(cell: str) -> list[str]:
    return re.findall(r"`([a-z_]+)`", cell)


# --- kv_connector_extra_config ---------------------------------------------------------


def _settings_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(RdmaSettings):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _parse_default(cell: str) -> Any:
    """A documented default as a value, or ``...`` when it is prose."""
    cell = re.sub(r"\s*\(.*\)$", "", cell.strip()).strip("`")
    if cell in ("true", "false"):
        return cell == "true"
    if cell == "unset":
        return None
    if cell == "{}":
        return {}
    if re.fullmatch(r'"[^"]*"', cell):
        return cell[1:-1]
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return ...


def _check_defaults(rows: list[list[str]], where: str) -> list[str]:
    defaults = _settings_defaults()
    wrong = []
    for row in rows:
        keys = _keys(row[0])
        values = [row[1]] if len(keys) == 1 else [v.strip() for v in row[1].split(",")]
        if len(values) != len(keys):
            continue
        for key, shown in zip(keys, values):
            value = _parse_default(shown)
            if value is ... or key not in defaults:
                continue
            actual = defaults[key]
            actual = dict(actual) if isinstance(actual, dict) else actual
            if isinstance(actual, (int, float)) and not isinstance(actual, bool) and isinstance(value, float):
                ok = float(actual) == value
            else:
                ok = actual == value
            if not ok:
                wrong.append(f"{where}: {key} documented {shown!r}, code {actual!r}")
    return wrong


def test_rdma_connector_settings_table_is_every_key_with_its_default() -> None:
    rows = _table_after(_text("docs/rdma-connector.md"), "## Configuration (`kv_connector_extra_config`)")
    documented = [k for row in rows for k in _keys(row[0])]
    assert sorted(set(documented) - set(EXTRA_KEYS)) == [], "documented keys the settings do not accept"
    assert sorted(set(EXTRA_KEYS) - set(documented)) == [], "settings keys docs/rdma-connector.md omits"
    assert _check_defaults(rows, "docs/rdma-connector.md") == []


def test_vllm_settings_table_names_only_keys_a_user_may_set() -> None:
    rows = _table_after(_text("docs/vllm.md"), "`kv_connector_extra_config` (unknown keys are rejected")
    documented = {k for row in rows for k in _keys(row[0])}
    assert sorted(documented - set(USER_KEYS)) == [], "docs/vllm.md documents keys vLLM users cannot set"
    assert _check_defaults(rows, "docs/vllm.md") == []


def test_connector_api_config_table_is_every_field_with_its_default() -> None:
    rows = _table_after(_text("docs/connector-api.md"), "## 1. Configuration: `KVTransferConfig`")
    documented = {_keys(row[0])[0]: row[1] for row in rows}
    assert list(documented) == list(KVTransferConfig.field_names())
    for f in dataclasses.fields(KVTransferConfig):
        shown = documented[f.name].strip("`")
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if f.name == "engine_id":
            assert shown == "a fresh UUID"
            continue
        value = getattr(default, "value", default)
        if isinstance(value, float):
            assert float(shown) == value, (f.name, shown)
        else:
            assert shown == (repr(value).replace("'", '"') if value is not None else "None"), (f.name, shown)


# --- the wire protocol ------------------------------------------------------------------


def _messages() -> dict[str, type[msgspec.Struct]]:
    out = {}
    for union in (wire.Request, wire.Reply):
        for cls in union.__args__:  # type: ignore[attr-defined]
            out[cls.__struct_config__.tag] = cls
    return out


def _top_level_fields(body: str) -> list[str]:
    """``a, b: T, c: [[x, y], ...]`` -> ``[a, b, c]`` (what is nested or in parentheses dropped)."""
    previous = None
    while previous != body:
        previous, body = body, re.sub(r"\[[^\[\]]*\]|\([^()]*\)", "", body)
    names = [part.split(":")[0].strip().strip("`") for part in body.split(",")]
    return [name for name in names if name and name != "..."]


def _documented_messages(text: str) -> dict[str, list[list[str]]]:
    """Every ``tag{fields}`` of the wire section's tables, and each request row's fields."""
    section = text[text.index("## Side channel wire protocol"):text.index("## Leases and validate-after-read")]
    found: dict[str, list[list[str]]] = {}
    for row in [*_table_after(section, "**Opening**"), *_table_after(section, "Requests (every one carries")]:
        for cell in row:
            for tag, body in re.findall(r"`?([a-z_]+)\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", cell):
                if body.strip() != "...":
                    found.setdefault(tag, []).append(_top_level_fields(body))
        if re.fullmatch(r"`[a-z_]+`", row[0]):  # a request row: `type` | fields | reply
            found.setdefault(row[0].strip("`"), []).append(_top_level_fields(row[1]))
    return found


def test_wire_tables_name_every_field_of_each_message() -> None:
    messages = _messages()
    documented = _documented_messages(_text("docs/rdma-connector.md"))
    assert documented, "no message found: is the parser broken?"
    wrong = []
    for tag, listings in documented.items():
        assert tag in messages, f"docs/rdma-connector.md names a message {tag!r} the wire does not have"
        fields = list(messages[tag].__struct_fields__)
        for listed in listings:
            if listed != fields:
                wrong.append(f"{tag}: documented {listed}, wire.py {fields}")
    assert wrong == []


def test_the_documented_records_are_the_wires() -> None:
    """``CompatInfo{...}`` and ``RankInfo{...}`` as the wire section spells them out."""
    text = _text("docs/rdma-connector.md")
    section = text[text.index("## Side channel wire protocol"):text.index("## Leases and validate-after-read")]
    for cls in (wire.CompatInfo, wire.RankInfo):
        m = re.search(rf"`{cls.__name__}\{{(.*?)\}}`", section, re.S)
        assert m, f"docs/rdma-connector.md no longer spells out {cls.__name__}"
        assert _top_level_fields(m.group(1)) == list(cls.__struct_fields__), cls.__name__


def test_the_documented_lease_is_the_wire_lease() -> None:
    text = _text("docs/rdma-connector.md")
    listed = re.search(r"leases: \[\[([a-z_, ]+)\], \.\.\.\]", text)
    assert listed and [f.strip() for f in listed.group(1).split(",")] == list(wire.LeaseWire.__struct_fields__)


def test_the_documented_protocol_version_is_the_wires() -> None:
    text = _text("docs/rdma-connector.md")
    assert f"## Side channel wire protocol (version {wire.PROTOCOL_VERSION})" in text
    assert f"version {wire.PROTOCOL_VERSION} (this release)" in text
    # and versions.py's history (PROTOCOL_VERSION's docstring) has an entry for it
    assert re.search(rf"^{wire.PROTOCOL_VERSION}\. \(", Path(versions.__file__).read_text(), re.M)


# --- modules and names ----------------------------------------------------------------------


def test_rdma_connector_module_table_lists_every_module() -> None:
    text = _text("docs/rdma-connector.md")
    rows = _table_after(text, "Code: `src/rdma_kv/connector/rdma/`")
    listed = {m for row in rows for m in re.findall(r"`([\w/]+\.py)`", row[0])}
    package = SRC / "rdma_kv" / "connector" / "rdma"
    present = {str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "__init__.py"}
    assert sorted(present - listed) == [], "modules docs/rdma-connector.md's table omits"
    assert sorted(listed - present) == [], "modules docs/rdma-connector.md's table names that do not exist"


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` (``rdma_kv.a.b.Name.attr``) names a module, or a
    name defined in one. Modules of the vLLM adapter are read, not imported
    (vLLM need not be installed)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        spec = importlib.util.find_spec(module) if _parent_is_package(module) else None
        if spec is None:
            continue
        rest = parts[i:]
        if not rest:
            return True
        if module == "rdma_kv.vllm" or module.startswith("rdma_kv.vllm."):
            assert spec.origin
            return re.search(rf"\b{re.escape(rest[0])}\b", Path(spec.origin).read_text()) is not None
        obj: Any = importlib.import_module(module)
        for name in rest:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _parent_is_package(module: str) -> bool:
    parent = module.rpartition(".")[0]
    if not parent:
        return True
    try:
        spec = importlib.util.find_spec(parent)
    except (ImportError, AttributeError):
        return False
    return spec is not None and spec.submodule_search_locations is not None


def test_every_rdma_kv_name_in_the_docs_exists() -> None:
    missing = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"`(rdma_kv(?:\.\w+)+)(?:\(\))?`", text):
            if not _resolves(m.group(1)):
                missing.append(f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(1)}")
    assert missing == []


# --- UCX defaults -------------------------------------------------------------------------


def test_the_ucx_defaults_an_operator_is_told_of_are_all_of_them() -> None:
    deploy = _text("docs/deploy.md")
    section_2 = deploy[deploy.index("## 2. Transports and devices"):deploy.index("## 3. ")]
    told = re.search(r"rdma-kv sets (.*?) in its own UCX context", section_2, re.S)
    assert told, "docs/deploy.md section 2 no longer lists the UCX defaults"
    named = dict(re.findall(r"`UCX_([A-Z_]+)=([^`]+)`", told.group(1)))
    assert named == DEFAULT_OPTIONS, "docs/deploy.md section 2's UCX defaults are not ucx.DEFAULT_OPTIONS"
    design = _text("docs/design.md")
    table = dict(re.findall(r"^\| `([A-Z_]+)=([^`]+)` \|", design, re.M))
    assert table == DEFAULT_OPTIONS, "docs/design.md's UCX defaults table is not ucx.DEFAULT_OPTIONS"


# --- messages quoted from the source --------------------------------------------------------


PLACEHOLDER_WORD = "\x00"


def _words(text: str) -> list[str]:
    """``text``'s words, punctuation around them dropped."""
    return re.findall(r"[\w\x00'=./-]*[\w\x00]", text)


def _source_strings() -> list[list[str]]:
    """The words of every string literal of src/rdma_kv, what an f-string or
    a %-format fills in written ``PLACEHOLDER_WORD`` (implicitly
    concatenated pieces joined as Python joins them), and the operating
    system's error texts (``os.strerror``) that messages carry."""
    pieces: list[str] = [os.strerror(code) for code in errno.errorcode]
    for path in (SRC / "rdma_kv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                pieces.append("".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str)
                                      else PLACEHOLDER_WORD for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                pieces.append(re.sub(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfgx]", PLACEHOLDER_WORD, node.value))
    return [_words(p) for p in pieces]


def _aligns(doc: list[str], code: list[str], i: int, j: int, filled: int) -> bool:
    """Whether ``doc[i:]`` reads as ``code`` from ``j`` on, a placeholder of
    the code standing for one to four words of the doc, and at most
    ``filled`` words of the doc in placeholders."""
    if i == len(doc):
        return True
    if j == len(code):
        return False
    if code[j] == PLACEHOLDER_WORD:
        return any(_aligns(doc, code, i + n, j + 1, filled - n) for n in range(1, min(4, filled) + 1)
                   if i + n <= len(doc))
    return doc[i] == code[j] and _aligns(doc, code, i + 1, j + 1, filled)


def _in_source(fragment: str, strings: list[list[str]]) -> bool:
    """Whether ``fragment`` is the wording of a source string, values aside:
    at most half of its words filled into the string's placeholders."""
    doc = _words(fragment)
    return any(_aligns(doc, code, 0, j, len(doc) // 2) for code in strings if len(set(doc) & set(code)) >= 3
               for j in range(len(code)) if code[j] in (doc[0], PLACEHOLDER_WORD))


PLACEHOLDER = re.compile(r"'[^']*'|<[^>]*>|…|\.\.\.|\S*\d\S*|\b[A-Z](?::[A-Z])?\b")
"""What a quoted message holds of one deployment: quoted ids, ``<...>``,
ellipses, any word with a digit (hosts, ports, counts, sizes), and a
capital standing for one (``N``, ``H:P``)."""


def _fragments(message: str) -> list[str]:
    """The wording of ``message``: its runs of at least four words between
    placeholders and the separators of nested messages (``: ``, ``; ``, parentheses)."""
    out = []
    for run in PLACEHOLDER.split(message):
        for part in re.split(r":\s|;\s|\s?\(|\)|,\s(?=[a-z]+\s)", run):
            part = " ".join(part.split()).strip(" ,.:;")
            if len(part.split()) >= 4:
                out.append(part)
    return out


def _quoted_messages(section: str) -> list[str]:
    lines: list[str] = []
    for block in re.findall(r"^```\n(.*?)^```", section, re.M | re.S):  # output blocks: no language
        lines.extend(line for line in block.splitlines() if line.strip())
    prose = re.sub(r"^```.*?^```", "", section, flags=re.M | re.S)
    lines.extend(span for span in re.findall(r"`([^`]+)`", prose)  # a message, not a command
                 if len(span.split()) >= 5 and re.search(r"'|: ", span))
    return lines


def test_troubleshooting_quotes_words_the_source_has() -> None:
    """docs/deploy.md section 8 says its messages are quoted from the
    source: every run of wording in them must be in a string literal of
    src/rdma_kv (reworded or removed messages fail)."""
    deploy = _text("docs/deploy.md")
    section = deploy[deploy.index("## 8. Troubleshooting by symptom"):deploy.index("## 9. Routers")]
    strings = _source_strings()
    messages = _quoted_messages(section)
    assert len(messages) > 10, "no quoted messages found: is the parser broken?"
    unknown = sorted({f for message in messages for f in _fragments(message) if not _in_source(f, strings)})
    assert unknown == [], "docs/deploy.md section 8 quotes wording no source string has"


def test_fragments_are_the_wording_between_values() -> None:
    message = ("peer P/tp0@10.0.0.5:14579#1 failed with 3 transfers in flight: did not complete transfer 17 "
               "within its deadline; the peer is considered dead and its endpoint was closed")
    assert _fragments(message) == ["did not complete transfer",
                                   "the peer is considered dead and its endpoint was closed"]
    assert _fragments("request '…': reads from 'P' rank 0 failed: the data read cannot be trusted") == [
        "the data read cannot be trusted"]


# --- commands -------------------------------------------------------------------------------


def _options(parser: Any) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def test_every_rdma_kv_flag_in_the_docs_exists() -> None:
    """``rdma-kv SUB ... --flag`` in README.md and docs/: a subcommand its
    parser has, and a flag that subcommand takes (``demo``'s are its own
    parsers')."""
    from rdma_kv.cli import build_parser
    from rdma_kv.cli.demo import transport_parser
    from rdma_kv.harness.demo import _parser as demo_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    options = {name: _options(p) for name, p in sub.choices.items()}  # type: ignore[union-attr]
    options["demo"] = _options(demo_parser()) | _options(transport_parser())
    wrong = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"rdma-kv ([a-z]+)((?:[ \t]+(?:\\\n\s*)?(?:--?[a-z][\w-]*(?:[= ][^\s`|)'\"]+)?))*)", text):
            name, rest = m.group(1), m.group(2)
            where = f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
            if name not in options:
                if re.match(r"rdma-kv [a-z]+(?:[ \t]+--|`)", m.group(0)):
                    wrong.append(f"{where}: no subcommand {name!r}")
                continue
            wrong.extend(f"{where}: rdma-kv {name} has no {flag}" for flag in re.findall(r"(?<!\S)(--?[a-z][\w-]*)", rest)
                         if flag not in options[name])
    assert wrong == []
