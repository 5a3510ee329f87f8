"""Lint of the C shim (``src/rdma_kv/transport/csrc``), the way msgspec's
``test_cpylint.py`` checks its C: rules read off the source text, so they
run anywhere (no compiler, no UCX).

- Every UCX non-blocking call (``ucp_*_nbx``) has its status accounted:
  its result goes to ``rk_account`` (which records a refusal and counts an
  operation done in place), and the batch's count was raised before the
  call (``rk_batch_inc``), so a completion on another thread never sees it
  reach zero early.
- A UCX status nobody looks at is discarded visibly, with ``(void)``.
- No control flow hides in a macro, and no macro stands in for a function.
- No ``Python.h``, no logging: the shim decides nothing and says nothing.
- The units depend one way (post.c -> pump.c -> core.c), and each stays
  readable in one sitting.
- The build keeps warnings as errors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "src" / "rdma_kv" / "transport" / "csrc"
UNITS = ("core.c", "pump.c", "post.c")  # each may call only the ones before it
MAX_LINES = 600


def source(name: str) -> str:
    return (CSRC / name).read_text()


def code(name: str) -> str:
    """The file without comments and string literals (so that prose never counts)."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), source(name), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def functions(name: str) -> dict[str, str]:
    """Every function defined at file scope: name -> body."""
    text = code(name)
    out = {}
    for m in re.finditer(r"^[A-Za-z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{", text, flags=re.M):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out[m.group(1)] = text[m.end():i - 1]
    return out


def calls(args_start: int, text: str) -> str:
    """The argument text of the call whose '(' is at ``args_start``."""
    depth, i = 1, args_start + 1
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[args_start + 1:i - 1]


@pytest.mark.parametrize("unit", UNITS)
def test_every_nbx_status_is_accounted_and_counted_first(unit):
    problems = []
    for fn, body in functions(unit).items():
        for m in re.finditer(r"\bucp_\w+_nbx\s*\(", body):
            call = m.group().rstrip("( ")
            before = body[:m.start()]
            # The result goes to rk_account: directly as an argument, or through
            # a variable assigned here and handed to rk_account afterwards.
            account = re.search(r"rk_account\s*\([^;]*$", before)
            assigned = re.search(r"(\w+)\s*=\s*$", before)
            if account is None and not (assigned and re.search(
                    rf"rk_account\s*\([^;]*\b{assigned.group(1)}\b", body[m.end():])):
                problems.append(f"{unit}:{fn}: {call}'s status is not passed to rk_account")
            if "rk_batch_inc" not in before:
                problems.append(f"{unit}:{fn}: {call} is not preceded by rk_batch_inc (the count goes up first)")
    assert not problems, "\n".join(problems)


def test_every_nbx_call_site_is_linted():
    """The rule above looks where the calls are: there must be some."""
    found = {u: len(re.findall(r"\bucp_\w+_nbx\s*\(", code(u))) for u in UNITS}
    assert found["post.c"] >= 3 and found["core.c"] >= 1, found


@pytest.mark.parametrize("unit", UNITS)
def test_a_discarded_ucx_status_is_discarded_visibly(unit):
    """``ucp_worker_signal`` and ``ucp_worker_arm`` return a status: used, or cast to void."""
    text = code(unit)
    bare = [m.group(1) for m in re.finditer(r"(?:^|[;{}])\s*(ucp_worker_(?:signal|arm)|ucp_worker_set_\w+)\s*\(",
                                             text, flags=re.M)]
    assert not bare, f"{unit}: status of {bare} dropped silently; use it or write (void)"


@pytest.mark.parametrize("unit", [*UNITS, "core.h", "shim.h"])
def test_no_control_flow_in_macros_and_no_function_macros(unit):
    text = code(unit)
    defines = re.findall(r"^\s*#\s*define\s+(\w+)(\(?)((?:[^\n]*\\\n)*[^\n]*)", text, flags=re.M)
    for name, paren, body in defines:
        assert not paren, f"{unit}: function-like macro {name}: write a function"
        assert not re.search(r"\b(return|goto|break|continue)\b", body), f"{unit}: macro {name} hides control flow"


@pytest.mark.parametrize("unit", [*UNITS, "core.h", "shim.h"])
def test_no_python_and_no_logging(unit):
    text = code(unit)
    assert not re.search(r"#\s*include\s*[<\"]Python\.h", source(unit)), unit
    assert not re.search(r"\b(printf|fprintf|puts|perror|syslog|ucs_(warn|error|info|debug|log))\b", text), unit


def test_the_units_depend_one_way():
    """core.c calls nothing of pump.c or post.c; pump.c nothing of post.c."""
    defined = {u: set(functions(u)) for u in UNITS}
    for i, unit in enumerate(UNITS):
        later = set().union(*(defined[u] for u in UNITS[i + 1:]))
        used = {name for name in later if re.search(rf"\b{name}\s*\(", code(unit))}
        assert not used, f"{unit} calls {sorted(used)} of a unit that depends on it"


def test_shim_h_is_plain_declarations():
    """cffi's cdef parses shim.h as it is: no preprocessor lines."""
    assert not re.search(r"^\s*#", code("shim.h"), flags=re.M)


@pytest.mark.parametrize("unit", UNITS)
def test_each_unit_reads_in_one_sitting(unit):
    lines = source(unit).count("\n")
    assert lines <= MAX_LINES, f"{unit}: {lines} lines (at most {MAX_LINES})"
    assert source(unit).startswith("/*"), f"{unit} opens with what it owns"


def test_warnings_are_errors():
    build = (CSRC.parent / "_build.py").read_text()
    for flag in ("-Wall", "-Wextra", "-Werror"):
        assert f'"{flag}"' in build, flag
    for unit in UNITS:
        assert f'"{unit}"' in build, f"{unit} is not compiled"
