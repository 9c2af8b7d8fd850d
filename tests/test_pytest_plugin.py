"""poptorch_lite.pytest_plugin: PopTorch's test files import `poptorch`, in the pytest process and
in the processes their tests spawn (data loader workers import the test file again)."""
import os
import subprocess
import sys
import textwrap


def test_poptorch_resolves_here_in_the_test_process_and_in_spawned_processes(tmp_path):
    (tmp_path / "spawned_test.py").write_text(textwrap.dedent("""
        import multiprocessing
        import poptorch

        def where(queue):
            import poptorch
            queue.put(type(poptorch.Options()).__module__)

        def test_spawned():
            assert type(poptorch.Options()).__module__.startswith("poptorch_lite")
            ctx = multiprocessing.get_context("spawn")
            queue = ctx.Queue()
            p = ctx.Process(target=where, args=(queue,))
            p.start()
            module = queue.get(timeout=120)
            p.join()
            assert module.startswith("poptorch_lite"), module
    """))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "poptorch_lite.pytest_plugin",
                          "-p", "no:cacheprovider", str(tmp_path / "spawned_test.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
