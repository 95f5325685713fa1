"""The gradwatch viewer: a Textual app over a pure model (:mod:`gradwatch.tui.state`); never imports torch."""
