"""`module:name` specs (rl.reward, rl.environment) that do not resolve say what would: the
closest name the module has ("did you mean"), else the names it has; a module that does not
import names PYTHONPATH. (The rewards' messages are checked end to end in
tests/system/test_bad_input.py.)"""

import pytest

from orchestrator.plugins import environments


@pytest.mark.parametrize("spec, says", [
    ("orchestrator.demo.calculator:Calculater", "orchestrator.demo.calculator has no class Calculater: did you mean Calculator?"),
    ("orchestrator.demo.calculator:Nothing", "has no class Nothing (it has Calculator)"),
    ("myenvs:Hint", "cannot import myenvs: No module named 'myenvs'; myenvs must be importable by every rank's Python: installed, "
                    "or its directory on PYTHONPATH"),
])
def test_an_environment_that_does_not_resolve_says_what_would(spec, says):
    with pytest.raises(ValueError) as caught:
        environments.load(spec)
    assert says in str(caught.value) and f"rl.environment={spec!r}" in str(caught.value)


def test_a_module_that_fails_inside_its_own_import_is_not_told_about_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "brokenenv.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as caught:
        environments.load("brokenenv:Env")
    assert "No module named 'no_such_dependency_here'" in str(caught.value) and "PYTHONPATH" not in str(caught.value)
