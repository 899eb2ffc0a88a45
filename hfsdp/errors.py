"""Errors that are the user's to fix: the CLI prints them without a traceback and exits 2."""


class UserError(Exception):
    """A problem in the user's config, data or command line, with a message that says how to fix it."""

    exit_code = 2


class RowError(UserError):
    """A data row that does not have the shape its format reads; the message says what is wrong and the fix.
    ``position``: the row's index in the batch the format was given, when the format knows it (``hfsdp.data.prepare``
    turns it into the row's number)."""

    def __init__(self, message: str, position: int | None = None):
        super().__init__(message)
        self.position = position


class ConfigError(UserError):
    """One or more problems in the training config, each tied to its YAML path."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "config"):
        self.problems = problems
        self.source = source
        lines = [f"{source}: {len(problems)} problem(s)"]
        lines += [f"  {path or '<top level>'}: {message}" for path, message in problems]
        super().__init__("\n".join(lines))


    def blamed_on(self, overrides: list[str]) -> "ConfigError":
        """These problems with each one of a key that an override (``--set key=value``) set, or of a key under it,
        named with its ``--set``, and ``--set`` as the source where every problem is one."""
        keys = {item.partition("=")[0].strip(): item for item in overrides}

        def given(path: str) -> str | None:
            return next((item for key, item in keys.items() if path == key or path.startswith((f"{key}.", f"{key}["))),
                        None)

        blamed = [(path, given(path)) for path, _ in self.problems]
        if not any(item for _, item in blamed) or self.source == "--set":
            return self
        if all(item for _, item in blamed):
            return ConfigError(self.problems, source="--set")
        return ConfigError([(f"{path} (--set {item})" if item else path, message)
                            for (path, item), (_, message) in zip(blamed, self.problems)], source=self.source)


class InvalidSectionRead(Exception):
    """A check read a config section that failed validation; that section's own problems are already reported, so
    the check is skipped rather than reported twice (see ``hfsdp.config.validate.InvalidSection``)."""

    def __init__(self, section: str):
        self.section = section
        super().__init__(f"section '{section}' is invalid")


class PluginError(Exception):
    """A plugin raised inside a hook; carries the plugin and hook names so every rank can report them."""

    exit_code = 1

    def __init__(self, plugin: str, hook: str, cause: BaseException):
        self.plugin = plugin
        self.hook = hook
        self.cause = cause
        super().__init__(f"plugin '{plugin}' failed in hook '{hook}': {type(cause).__name__}: {cause}")


class Stopped(BaseException):
    """SIGTERM or SIGINT outside the training loop (where they ask for a checkpoint instead,
    ``hfsdp.run.loop.PreemptionFlag``): raised by the handler ``hfsdp train`` installs, so that what the run started
    is undone on the way out (an earlier run it set aside is put back, a temporary export removed). A BaseException,
    as KeyboardInterrupt: no ``except Exception`` turns it into another error. The CLI exits 128 + the signal's
    number, as a process killed by it would."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")
