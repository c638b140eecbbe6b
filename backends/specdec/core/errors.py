"""Typed errors: what the Triton glue turns into error responses with the message as it is."""


class SpecdecError(Exception):
    """Base class of every error specdec raises on purpose."""


class InvalidRequest(SpecdecError, ValueError):
    """A request's arguments are wrong; the message names the argument and the allowed range."""


class ConfigurationError(SpecdecError, ValueError):
    """An engine or proposer configuration cannot work (e.g. a draft with another tokenizer)."""


class QueueTimeout(SpecdecError):
    """A request waited longer than allowed for a free KV slot."""
