"""The test tree as pytest collects it: every module a basename of its own.

pytest's default import mode (``prepend``) imports each test module by its
basename, the tests' directories having no ``__init__.py``; two files of one
name in two directories stop a run that collects both at collection
("import file mismatch"), and CI collects all of them. A run of one
directory does not see it, so this says it in any run."""

from __future__ import annotations

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def test_every_test_module_has_a_basename_of_its_own():
    by_name = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts and path.name != "__init__.py" and path.name != "conftest.py":
            by_name[path.name].append(str(path.relative_to(TESTS)))
    assert len(by_name) > 50  # the tree was found
    twice = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not twice, f"test modules sharing a basename (rename one): {twice}"
