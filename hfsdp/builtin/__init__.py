"""First-party plugins. They use the same hooks and entry points as third-party plugins."""
