"""First-party plugins, a folder each: its hooks and what it is in ``__init__.py``, beside modules of its own
(``schema.py``: its config section; ``loss.py``: its loss, with torch, imported when a run trains). They use the same
hooks and entry points as third-party plugins. ``online/``, ``reference_model/`` and ``reference_free/`` are no
plugins: they hold what several objectives share."""
