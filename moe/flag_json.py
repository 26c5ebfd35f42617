"""The JSON-object values of vLLM's config flags (``--compilation-config``, ``--profiler-config``).

Torch-free, so each flag's own parser (``moe.compilation.config``, ``launch.engine.profiler``)
checks the same things in the same words before it reads its keys.
"""

from __future__ import annotations

import json
from collections.abc import Iterable


def parse_json_object(flag: str, text: str, supported: Iterable[str]) -> dict:
    """``text`` (the value of ``flag``) as a dict whose keys are all in ``supported``.

    Raises:
        ValueError: not valid JSON, not a JSON object, or a key outside ``supported`` (naming
            the unknown keys and the supported ones).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {text!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    supported = list(supported)
    unknown = sorted(set(value) - set(supported))
    if unknown:
        raise ValueError(f"{flag} keys {unknown} are not supported; supported: {supported}")
    return value
