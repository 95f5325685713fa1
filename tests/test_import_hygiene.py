"""Layering, enforced: the trainer side never loads the viewer stack; `import gradwatch` is cheap."""

from __future__ import annotations

import subprocess

from conftest import PY

HEAVY_UI = ("textual", "rich", "plotext", "textual_plotext")
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([PY, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, env={"GRADWATCH_RUNTIME_DIR": "/tmp/gw-hygiene",
                                                                          "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_import_gradwatch_is_light() -> None:
    mods = _modules_after("import gradwatch")
    for name in (*HEAVY_UI, "torch", "zmq", "pdb", "numpy"):
        assert name not in mods, name


def test_watch_loads_no_ui_and_no_pdb() -> None:
    mods = _modules_after(
        "import torch, gradwatch\n"
        "m = torch.nn.Linear(2, 2); gw = gradwatch.watch(m, torch.optim.SGD(m.parameters(), lr=0.1), announce=False)\n"
        "m(torch.randn(1, 2)).sum().backward(); gw.step(); gw.close()"
    )
    for name in (*HEAVY_UI, *FRAMEWORKS, "pdb", "readline"):
        assert name not in mods, name
    assert "gradwatch.publisher.watcher" in mods


def test_the_core_imports_no_framework_and_each_adapter_only_its_own() -> None:
    assert not set(FRAMEWORKS) & _modules_after("import gradwatch.integrations, gradwatch.publisher.watcher")
    mods = _modules_after("import gradwatch.integrations.accelerate")  # accelerate is imported by the user
    assert not set(FRAMEWORKS) & mods
    assert "lightning" in _modules_after("import gradwatch.integrations.lightning")  # (which loads transformers itself)


def test_client_and_cli_do_not_need_torch() -> None:
    mods = _modules_after("import gradwatch, gradwatch.client, gradwatch.cli; gradwatch.runs()")
    assert "torch" not in mods


def test_diagnosis_and_control_client_load_neither_torch_nor_ui() -> None:
    """The alert rules run in the trainer and in the viewer: pure Python and numpy. The command client
    (gradwatch debug, the viewer's link) needs no torch and no Textual; the viewer needs no torch."""
    mods = _modules_after("import gradwatch.diagnose, gradwatch.controller, gradwatch.tui.control")
    for name in (*HEAVY_UI, "torch", "pdb"):
        assert name not in mods, name
    mods = _modules_after("import gradwatch.tui.app, gradwatch.tui.pause, gradwatch.tui.screens.console")
    assert "torch" not in mods and "pdb" not in mods


def test_the_sidecar_and_the_records_it_reads_never_import_torch() -> None:
    """The sidecar runs beside the trainer on its own core: importing torch there would cost it ~1 s at start
    and hundreds of MiB (docs/design.md, "The sidecar")."""
    mods = _modules_after("import gradwatch.publisher.sidecar, gradwatch.publisher.raw_record, gradwatch.publisher.slots")
    assert "torch" not in mods and "gradwatch.publisher.raw_record" in mods
