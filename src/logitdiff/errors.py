"""One error type whose message is the single line the CLI prints."""


class LogitdiffError(Exception):
    """A user-facing error: bad input, mismatched runs, unreachable source.

    The message must be one line naming the file, item, position or field at fault.
    The CLI prints ``error: <message>`` and exits with status 2.
    """
