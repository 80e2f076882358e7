"""Errors raised by communicators."""


class CommError(RuntimeError):
    """A transport failed (a peer died, a timeout, a misconfigured launcher)."""


class CollectiveMismatchError(CommError):
    """Ranks called a collective with different arguments (found with COMMOPT_DEBUG=1)."""
