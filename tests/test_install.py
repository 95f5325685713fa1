"""The viewer installed from a built wheel into a fresh venv with no torch (issue 11, item 1).

This is the README's "viewer alone" install: the wheel's dependencies must not pull torch in, the
`gradwatch` command must work as installed (no repository on PYTHONPATH), it must find and show a
trainer that runs in another environment (the project's venv), and `gradwatch.watch()` there must say
in one line why it cannot run. Needs the package index (or pip's cache) for the build backend and the
dependencies; without it the test is skipped and says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import pytest

from conftest import PY, ROOT, child_env
from gradwatch.__about__ import __version__

pytestmark = pytest.mark.timeout(600)


def _pip(*args: str, python: str = PY, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "-q", *args], capture_output=True,
                          text=True, timeout=480, cwd=cwd)


def _source(root: Path) -> Path:
    src = root / "src"  # a copy without build outputs or the venv, as a fresh clone would be
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "dist",
                                                             "build", "results", ".pytest_cache", "*.so"))
    return src


def _wheel(root: Path, src: Path, **env: str) -> Path:
    built = subprocess.run([PY, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps", "-w",
                            str(root / "dist"), str(src)], capture_output=True, text=True, timeout=480,
                           env={**os.environ, **env})
    if built.returncode != 0:
        pytest.skip(f"cannot build the wheel here (no package index for setuptools?): {built.stderr.strip()[-300:]}")
    (wheel,) = (root / "dist").glob("gradwatch-*.whl")
    return wheel


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    return _wheel(root, _source(root))


@pytest.fixture(scope="module")
def viewer_venv(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    wheel = built_wheel
    venv = root / "v"
    subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", str(venv)], check=True, timeout=120)
    installed = _pip("install", str(wheel), python=str(venv / "bin" / "python"))
    if installed.returncode != 0:
        pytest.skip(f"cannot install the wheel's dependencies here (no package index?): "
                    f"{installed.stderr.strip()[-300:]}")
    return venv


def _clean_env(runtime: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(GRADWATCH_RUNTIME_DIR=str(runtime), GRADWATCH_RECORD_DIR=str(runtime / "rec"))
    return env


def test_the_wheel_installs_the_viewer_without_torch_and_it_watches_a_real_trainer(viewer_venv: Path,
                                                                                   runtime: Path) -> None:
    gw = str(viewer_venv / "bin" / "gradwatch")
    py = str(viewer_venv / "bin" / "python")
    env = _clean_env(runtime)
    no_torch = subprocess.run([py, "-c", "import torch"], capture_output=True, text=True, env=env, timeout=60)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    where = subprocess.run([py, "-c", "import gradwatch; print(gradwatch.__file__)"], capture_output=True,
                           text=True, env=env, timeout=60, cwd="/")
    assert where.stdout.startswith(str(viewer_venv)), where  # the installed copy, not the repository
    version = subprocess.run([gw, "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"gradwatch {__version__}", version
    # watch() in the viewer's environment: one line that says what to do, no chained ModuleNotFoundError
    watch = subprocess.run([py, "-c", "import gradwatch; gradwatch.watch(object())"], capture_output=True,
                           text=True, env=env, timeout=60)
    last = watch.stderr.strip().splitlines()[-1]
    assert watch.returncode != 0 and last.startswith("ImportError: gradwatch.watch() runs inside a PyTorch")
    assert "install gradwatch into the training environment" in last and "During handling" not in watch.stderr

    name = f"wheel-{uuid.uuid4().hex[:6]}"
    trainer = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), "100000", "--pace", "0.02", "--name", name],
                               cwd=ROOT, env=child_env(runtime), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    session = f"gw{uuid.uuid4().hex[:6]}"
    try:
        run = trainer.stdout.readline().split()[1]  # type: ignore[union-attr]
        ls = subprocess.run([gw, "ls"], capture_output=True, text=True, env=env, timeout=60)
        assert ls.returncode == 0 and run in ls.stdout and "live" in ls.stdout, ls
        if shutil.which("tmux") is None:
            pytest.skip("tmux is not installed (scripts/test installs it): the viewer part is not run")
        exports = f"GRADWATCH_RUNTIME_DIR={runtime} GRADWATCH_RECORD_DIR={runtime / 'rec'}"
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "140", "-y", "40",
                        f"env -u PYTHONPATH -u COLUMNS -u LINES {exports} {gw} attach {name}"], check=True)
        deadline = time.monotonic() + 60
        screen = ""
        while time.monotonic() < deadline:
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
            if " LIVE " in screen and "0.weight" in screen:
                break
            time.sleep(0.25)
        assert " LIVE " in screen and "0.weight" in screen and name in screen, screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        trainer.kill()
        trainer.wait(10)


def test_the_wheel_carries_the_compiled_steady_step(built_wheel: Path) -> None:
    names = _names(built_wheel)
    assert any(n.startswith("gradwatch/publisher/_native.") and n.endswith(".so") for n in names), names
    assert "gradwatch/tui/app.tcss" in names and "gradwatch/py.typed" in names  # the package data too
    assert not built_wheel.name.endswith("-none-any.whl")  # a platform wheel: it holds compiled code


def test_without_a_compiler_the_wheel_still_builds_and_its_trainer_side_copies_instead(
        tmp_path: Path, runtime: Path) -> None:
    """The extension is optional (setup.py): no C compiler at install time must not mean no gradwatch."""
    wheel = _wheel(tmp_path, _source(tmp_path), CC="/bin/false")
    names = _names(wheel)
    assert not any("_native." in n and n.endswith(".so") for n in names), names
    assert "gradwatch/publisher/native.py" in names
    # that package, unpacked beside this environment's torch: it says why, and its steady step copies
    (tmp_path / "site").mkdir()
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
    code = ("import gradwatch.publisher.native as n, gradwatch; print(n.grad_sumsq is None, n.why_not.split()[0], "
            "gradwatch.__file__)")
    env = {**child_env(runtime), "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    none, why, where = out.stdout.split()
    assert (none, why) == ("True", "not"), out.stderr
    assert where.startswith(str(tmp_path / "site"))
