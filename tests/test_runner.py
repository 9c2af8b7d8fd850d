"""The drop-in runner: `python -m poptorch_lite run script.py` runs unmodified PopTorch programs
with `poptorch`, `poptorch.optim`, `popdist` and `popdist.poptorch` resolving to this project,
and refuses PopTorch names it does not provide with errors naming them."""
import importlib
import os
import subprocess
import sys
import textwrap

import pytest

import poptorch_lite
import poptorch_lite.api.optim
from poptorch_lite import runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(tmp_path, source: str, *args: str, module: bool = False):
    """Write `source` as prog.py in tmp_path and run it through the runner in a new process."""
    (tmp_path / "prog.py").write_text(textwrap.dedent(source))
    target = ["-m", "prog"] if module else [str(tmp_path / "prog.py")]
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "poptorch_lite", "run", *target, *args], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def aliases():
    """install() in this process, undone afterwards."""
    saved_path = list(sys.meta_path)
    saved = {n: m for n, m in sys.modules.items() if n == "poptorch" or n.startswith("poptorch.")}
    runner.install()
    yield importlib.import_module("poptorch")
    sys.meta_path[:] = saved_path
    for name in [n for n in sys.modules if n == "poptorch" or n.startswith("poptorch.")]:
        del sys.modules[name]
    sys.modules.update(saved)


def test_poptorch_resolves_to_poptorch_lite(aliases):
    import poptorch.optim
    from poptorch import Options, trainingModel

    assert aliases.Options is poptorch_lite.Options and Options is poptorch_lite.Options
    assert trainingModel is poptorch_lite.trainingModel
    assert poptorch.optim.AdamW is poptorch_lite.api.optim.AdamW
    assert aliases.optim is sys.modules["poptorch.optim"]  # the attribute is the aliased submodule
    assert isinstance(Options(), aliases.Options)
    assert "PipelinedExecution" in dir(aliases)


def test_unsupported_names_fail_naming_the_call(aliases):
    with pytest.raises(NotImplementedError, match=r"poptorch\.nonexistent_op is not supported by poptorch_lite"):
        aliases.nonexistent_op(None)
    with pytest.raises(AttributeError, match=r"poptorch\.optim\.VariableSGD is not supported"):
        aliases.optim.VariableSGD
    with pytest.raises(NotImplementedError, match=r"Did you mean poptorch\.Options\?"):
        aliases.Optons
    with pytest.raises(NotImplementedError, match=r"poptorch\.nonexistent_op is not supported"):
        exec("from poptorch import nonexistent_op", {})
    with pytest.raises(ImportError, match=r"poptorch\.no_such_module is not supported"):
        importlib.import_module("poptorch.no_such_module")
    assert not hasattr(aliases, "nonexistent_op")  # feature probes still get False
    assert getattr(aliases, "nonexistent_op", "absent") == "absent"


def test_classes_are_not_modules(aliases):
    with pytest.raises(ModuleNotFoundError, match="No module named 'poptorch.Options'"):
        importlib.import_module("poptorch.Options")


def test_script_runs_as_main_with_its_arguments(tmp_path):
    out = run_cli(tmp_path, """
        import os, sys
        import poptorch, poptorch.optim
        import popdist, popdist.poptorch
        print("name", __name__)
        print("argv", sys.argv)
        print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
        print("alias", poptorch.__name__, type(poptorch.Options()).__module__)
        print("popdist", popdist.poptorch.Options.__module__, os.path.dirname(popdist.__file__))
        """, "--epochs", "2", "x")
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["name"] == "__main__"
    assert lines["argv"] == repr([str(tmp_path / "prog.py"), "--epochs", "2", "x"])
    assert lines["path0"] == "True"
    assert lines["alias"] == "poptorch poptorch_lite.api.options"
    assert lines["popdist"] == f"popdist.poptorch {os.path.join(REPO, 'popdist')}"


def test_module_mode_and_exit_status(tmp_path):
    out = run_cli(tmp_path, """
        import sys
        import poptorch
        print(__name__, sys.argv[1:])
        sys.exit(3)
        """, "a", module=True)
    assert out.returncode == 3, out.stderr
    assert out.stdout.strip() == "__main__ ['a']"


def test_unsupported_call_stops_the_program_with_its_name(tmp_path):
    out = run_cli(tmp_path, """
        import poptorch
        opts = poptorch.Options()
        poptorch.nonexistent_op(None)
        print("unreachable")
        """)
    assert out.returncode != 0 and "unreachable" not in out.stdout
    assert "UnsupportedAttributeError: poptorch.nonexistent_op is not supported" in out.stderr


def test_missing_program_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "poptorch_lite", "run", str(tmp_path / "nope.py")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode != 0 and "no such file" in out.stderr


def test_command_is_required():
    with pytest.raises(SystemExit) as stop:
        runner.main([])
    assert stop.value.code == 2


def test_the_alias_is_for_the_run_only():
    """Nothing is installed globally: outside a run `poptorch` is whatever the machine has."""
    out = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; import poptorch_lite.runner; "
                          "s = u.find_spec('poptorch'); print(s is None or 'poptorch_lite' not in str(s.origin))"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    assert out.stdout.strip() == "True", out.stderr


@pytest.mark.slow
def test_unmodified_training_script_with_async_loader(tmp_path):
    """A PopTorch training script whose asynchronous DataLoader spawns a worker process that
    re-imports the program (and so `poptorch`) trains on emulated IPUs."""
    out = run_cli(tmp_path, """
        import torch
        import poptorch


        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 2)
                self.loss = torch.nn.CrossEntropyLoss()

            def forward(self, x, y):
                out = self.fc(x)
                return out, self.loss(out, y)


        if __name__ == "__main__":
            torch.manual_seed(0)
            x = torch.randn(64, 4)
            y = (x[:, 0] > 0).long()
            opts = poptorch.Options().deviceIterations(2)
            loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True,
                                         mode=poptorch.DataLoaderMode.Async)
            model = Model()
            training = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.5))
            losses = []
            for epoch in range(3):
                for xs, ys in loader:
                    _, loss = training(xs, ys)
                    losses.append(float(loss))
            print("losses", losses[0], losses[-1])
        """)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, out.stdout.split("losses ")[1].split())
    assert last < first
