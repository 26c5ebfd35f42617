"""What the DP ranks of an offline run agree on before any engine step: whether every rank's
input was valid. A rank that refuses its input must not leave the others waiting in the first
step's collective, so every rank raises, naming the rank and the reason."""

from __future__ import annotations


def agree_on_input(error: Exception | None, groups) -> None:
    """Raise on every DP rank if any rank's input was refused (``error`` is this rank's).

    Collective over ``groups.dp_group`` when ``groups.dp_size > 1`` (one blocking
    ``all_gather_object``, the group's timeout); every rank must call it, valid input or not.

    Raises:
        ValueError / TypeError: this rank's ``error`` itself; else the first failing rank's, as
            the same type prefixed with ``DP rank k:`` (RuntimeError for other types).
    """
    if groups.dp_size > 1:
        import torch.distributed as dist

        mine = None if error is None else (_kind(error), str(error))
        everyone: list = [None] * groups.dp_size
        dist.all_gather_object(everyone, mine, group=groups.dp_group)  # blocking, group timeout
    else:
        everyone = [None]
    if error is not None:
        raise error
    for dp_rank, failure in enumerate(everyone):
        if failure is not None:
            kind, message = failure
            cls = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
            raise cls(f"DP rank {dp_rank}: {message}")


def _kind(error: Exception) -> str:
    """The builtin type the other ranks raise (a ProtocolError is a ValueError)."""
    for cls in (TypeError, ValueError):
        if isinstance(error, cls):
            return cls.__name__
    return type(error).__name__
