"""Keys as terminal users expect them: the help rows, the command palette's commands, and the config file.

Everything is generated from the bindings themselves (the app's, the alert pane's, the console's), so
help and palette cannot go stale. The config file, ``$XDG_CONFIG_HOME/gradwatch/config.toml``
(``~/.config/gradwatch/config.toml``), rebinds keys by binding id and picks a theme::

    theme = "textual-light"
    [keys]
    pause_trainer = "p"          # binding id = "comma,separated,keys"
    quit = "q,ctrl+c"

A bad file never stops the viewer: each problem is one line, shown as a notification.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Iterable

from textual.binding import Binding

#: Keys that are not App bindings (widgets own them), with what they do and their binding id, if any.
EXTRA_KEYS: tuple[tuple[str, str, str], ...] = (
    ("tab / shift+tab", "move focus: table, alerts", ""),
    ("enter", "on a row: plot that layer's history; on an alert: jump to its layer and mark its step", ""),
    ("x", "on an alert: silence alerts of its kind (u shows them again)", "alerts.silence_kind"),
    ("X", "on an alert that names a layer: silence alerts about that layer", "alerts.silence_layer"),
    ("ctrl+p", "command palette: every action by name", ""),
    ("escape", "in the debugger console: continue training and close it", "console.leave"),
    ("ctrl+x", "in the debugger console: abort the run (asks first)", "console.abort"),
    ("ctrl+c / ctrl+q", "quit (a paused trainer is resumed first)", "quit_ctrl_c"),
)


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "gradwatch" / "config.toml"


def _bindings(app: Any) -> list[Binding]:
    return [b for b in app.BINDINGS if isinstance(b, Binding)]


def help_rows(app: Any) -> list[tuple[str, str, str]]:
    """(key, what it does, binding id) for every key this viewer offers now, App bindings first."""
    rows = []
    for b in _bindings(app):
        if not b.description or app.check_action(b.action, ()) is False:
            continue
        keys = app._keymap.get(b.id, b.key) if b.id and hasattr(app, "_keymap") else b.key  # noqa: SLF001
        rows.append((b.key_display or keys, b.tooltip or b.description, b.id or ""))
    return rows + [row for row in EXTRA_KEYS if row[2] not in {r[2] for r in rows if r[2]}]


def commands(app: Any) -> Iterable[tuple[str, str, str]]:
    """(title, help, action) for the command palette: each App binding the viewer offers now."""
    for b in _bindings(app):
        if not b.description or b.action in ("quit", "help") or app.check_action(b.action, ()) is False:
            continue
        title = b.description[0].upper() + b.description[1:]
        yield f"{title} ({b.key_display or b.key})", b.tooltip or b.description, b.action


def _toml(text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("reading it needs Python 3.11+ or the tomli package") from None
    return tomllib.loads(text)


def load_config(app: Any, path: Path | None = None) -> list[str]:
    """Apply the config file to ``app`` (keymap, theme); return one-line problems. Never raises."""
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{path}: cannot read it ({exc.__class__.__name__}); defaults used"]
    try:
        data = _toml(text)
    except ValueError as exc:
        return [f"{path}: not valid TOML ({str(exc).splitlines()[0][:120]}); defaults used"]
    problems: list[str] = []
    known = {b.id for b in _bindings(app) if b.id} | {row[2] for row in EXTRA_KEYS if row[2]}
    keys = data.get("keys", {})
    keymap: dict[str, str] = {}
    if not isinstance(keys, dict):
        problems.append(f"{path}: [keys] must be a table of binding id = \"keys\"")
        keys = {}
    for bid, value in keys.items():
        if bid not in known:
            problems.append(f"{path}: no binding with id {bid!r} (see ? for the ids)")
        elif not isinstance(value, str) or not value.strip():
            problems.append(f"{path}: keys.{bid} must be a string like \"p\" or \"q,ctrl+c\"")
        else:
            keymap[bid] = value.replace(" ", "")
    if keymap:
        app.set_keymap(keymap)
    theme = data.get("theme")
    if theme is not None:
        if isinstance(theme, str) and theme in app.available_themes:
            app.theme = theme
        else:
            problems.append(f"{path}: unknown theme {theme!r} (known: {', '.join(sorted(app.available_themes))})")
    for extra in sorted(set(data) - {"keys", "theme"}):
        problems.append(f"{path}: unknown setting {extra!r} (known: theme, [keys])")
    return problems
