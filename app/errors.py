"""The one error type a command turns into a clear line and exit status 2."""


class ConfigError(ValueError):
    """A bad argument or setting: the CLI prints it as one line and exits 2."""
